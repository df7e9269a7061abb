"""Scheduling policies: the order of the waiting queue, the order of the running batch, and who may preempt whom.

- fcfs: arrival order; a preempted request goes back to the front of the queue; when blocks run out the
  newest running request is preempted. Nothing waiting ever preempts anything running.
- priority: by (priority, arrival), lower first (vLLM's convention). When blocks or batch slots run out, the
  worst request is preempted (the newest among equals), and a waiting request may preempt running requests
  that sort after it, so a better request starts at once instead of after the worse work finishes.
- fair: as priority, and among equal priorities by the tenant's share of computed tokens: the tenant that has
  had the fewest tokens computed goes first (virtual time over computed tokens), so a tenant with 500 queued
  requests cannot starve one with 2.

Plain Python, no tensors; the scheduler asks, the policy answers.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from typing import Iterator, Optional

from pagedserve.core.request import Request


class FCFSQueue(deque):
    """The waiting queue in arrival order; preempted requests go back to its front."""

    def push(self, request: Request) -> None:
        self.append(request)

    def push_front(self, request: Request) -> None:
        self.appendleft(request)

    def peek(self) -> Request:
        return self[0]

    def pop_head(self) -> Request:
        return self.popleft()

    def pop_at(self, index: int) -> Request:
        """Take the request at `index` out (the scheduler passes over some, see Scheduler._first_admissible)."""
        request = self[index]
        del self[index]
        return request


class SortedQueue:
    """The waiting queue kept sorted by a policy's key (stable: the key ends in an arrival sequence number).
    A preempted request goes back to where its key puts it, ahead of everything that arrived after it."""

    def __init__(self, key) -> None:
        self._key = key
        self._keys: list[tuple] = []
        self._requests: list[Request] = []

    def push(self, request: Request) -> None:
        key = self._key(request)
        index = bisect.bisect_right(self._keys, key)
        self._keys.insert(index, key)
        self._requests.insert(index, request)

    push_front = push

    def peek(self) -> Request:
        return self._requests[0]

    def pop_head(self) -> Request:
        return self.pop_at(0)

    def pop_at(self, index: int) -> Request:
        self._keys.pop(index)
        return self._requests.pop(index)

    def remove(self, request: Request) -> None:
        index = self._requests.index(request)
        del self._keys[index], self._requests[index]

    def resort(self) -> None:
        """Re-key every entry (the fair policy's keys move as tenants get tokens computed)."""
        pairs = sorted(((self._key(r), r) for r in self._requests), key=lambda pair: pair[0])
        self._keys = [k for k, _ in pairs]
        self._requests = [r for _, r in pairs]

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests))


class FCFSPolicy:
    name = "fcfs"
    preemptive = False
    """Whether the running batch is ordered by key and a waiting request may preempt worse running ones."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._arrival_seq: dict[str, int] = {}

    def new_waiting_queue(self):
        return FCFSQueue()

    def on_add(self, request: Request) -> None:
        self._arrival_seq[request.request_id] = next(self._seq)

    def on_finish(self, request: Request) -> None:
        self._arrival_seq.pop(request.request_id, None)

    def on_computed(self, request: Request, num_tokens: int) -> None:
        pass

    def before_schedule(self, waiting) -> None:
        pass

    def key(self, request: Request) -> tuple:
        return (request.arrival_time, self._arrival_seq.get(request.request_id, 0))

    def may_preempt(self, waiting: Request, running: Request) -> bool:
        return False


class PriorityPolicy(FCFSPolicy):
    name = "priority"
    preemptive = True

    def new_waiting_queue(self):
        return SortedQueue(self.key)

    def key(self, request: Request) -> tuple:
        return (request.priority, *super().key(request))

    def may_preempt(self, waiting: Request, running: Request) -> bool:
        return waiting.priority < running.priority


class FairPolicy(PriorityPolicy):
    """Virtual time per tenant = tokens computed for it while it has had requests in the engine. A tenant that
    becomes active starts just ahead of the least-served active tenant (not at 0, which would let it monopolise
    the engine until it caught up, and not at its old count, which would punish it for past use).

    Recomputing a preempted request's tokens is not charged to its tenant (the scheduler chose to drop them),
    and a waiting request preempts another tenant's running one of equal priority only when its tenant is
    more than `preempt_gap` tokens behind even after its own prompt: otherwise the admission order alone
    evens the shares out, and preemptions do not ping-pong between tenants."""

    name = "fair"

    def __init__(self, preempt_gap: int = 2048) -> None:
        super().__init__()
        self.preempt_gap = preempt_gap
        self.served: dict[Optional[str], int] = {}
        self._active: dict[Optional[str], int] = {}  # tenant -> requests in the engine
        self._progress: dict[str, int] = {}  # request id -> most tokens it has ever had computed

    def on_add(self, request: Request) -> None:
        super().on_add(request)
        tenant = request.tenant
        if self._active.get(tenant, 0) == 0:
            # Just ahead of the least-served active tenant: a newcomer's first request goes next, not after
            # everything queued before it at the same level.
            self.served[tenant] = min((self.served[t] for t, n in self._active.items() if n), default=1) - 1
        self._active[tenant] = self._active.get(tenant, 0) + 1

    def on_finish(self, request: Request) -> None:
        super().on_finish(request)
        self._progress.pop(request.request_id, None)
        tenant = request.tenant
        self._active[tenant] -= 1
        if self._active[tenant] == 0:
            del self._active[tenant]
            del self.served[tenant]

    def on_computed(self, request: Request, num_tokens: int) -> None:
        # Called after request.num_computed_tokens has advanced by num_tokens.
        before = self._progress.get(request.request_id, 0)
        if request.num_computed_tokens > before:
            self.served[request.tenant] += request.num_computed_tokens - before
            self._progress[request.request_id] = request.num_computed_tokens

    def before_schedule(self, waiting) -> None:
        waiting.resort()

    def key(self, request: Request) -> tuple:
        return (request.priority, self.served.get(request.tenant, 0), *FCFSPolicy.key(self, request))

    def may_preempt(self, waiting: Request, running: Request) -> bool:
        if waiting.priority != running.priority:
            return waiting.priority < running.priority
        if waiting.tenant == running.tenant:
            return False  # first come, first served within a tenant
        behind = self.served[running.tenant] - self.served[waiting.tenant] - waiting.num_tokens
        return behind > self.preempt_gap


POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy, "fair": FairPolicy}


def make_policy(name: str, max_num_batched_tokens: int = 2048) -> FCFSPolicy:
    """The policy of that name; under `fair`, a tenant must be more than one full step's tokens behind
    another to preempt it."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose from {', '.join(POLICIES)}")
    return FairPolicy(max_num_batched_tokens) if name == "fair" else POLICIES[name]()
