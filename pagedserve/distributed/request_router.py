"""PagedServeRequestRouter: RoutingPolicy as a Ray Serve RequestRouter for the engine deployment.

Ray Serve keeps one router per deployment handle, in the process that holds the handle (the ingress). What the
router needs travels in the call's keyword arguments, from RemoteEngine: `routing=` (the prompt's block hashes),
`avoid=` (replicas that failed this request before), `call_id=` (one per try). Load is what this router has in
flight on each replica (counted when a request is sent, uncounted when Ray reports it complete, whatever its
outcome) plus the requests ranked onto it and not sent yet: Ray ranks a burst of arrivals before it sends any
of them, and without these a flood would all see the same load and go to one replica. Calls to every replica
(metrics, prefix-cache resets) are Serve broadcasts and never pass through here.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, defaultdict, deque
from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.distributed.routing_policy import RouterConfig, RoutingPolicy

MAX_REMEMBERED_CHOICES = 1 << 14
RESERVATION_TTL_S = 10.0
"""A ranked call that was never sent (cancelled before Ray sent it) stops counting as load after this long."""


class PagedServeRequestRouter(FIFOMixin, RequestRouter):
    # FIFOMixin: every call one HTTP request makes (n prompts, retries) shares Ray's internal request id, and
    # without it Ray's base class matches a chosen replica to a waiting call by that id: all but one would wait
    # for ever. With it, a replica chosen while several calls wait goes to the oldest (rare: only while replicas
    # are full or being probed).

    def initialize_state(self, policy: str = "prefix", imbalance_threshold: int = 8,
                         index_capacity: int = 1 << 17) -> None:
        self.policy = RoutingPolicy(RouterConfig(policy, imbalance_threshold, index_capacity))
        self.in_flight: Counter[str] = Counter()
        self._reserved: defaultdict[str, deque[float]] = defaultdict(deque)
        """replica -> when each call ranked onto it and not yet sent was ranked (oldest first)."""
        self._chosen: OrderedDict[str, tuple[str, list[bytes]]] = OrderedDict()
        """call id -> the replica its ranking put first, and the hashes that put there anew (bounded: a call
        cancelled before it was routed is never popped)."""

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        avoid = set(pending_request.kwargs.get("avoid") or ()) if pending_request is not None else set()
        if len(by_id.keys() - avoid) > 0:  # a replica whose engine failed this request, unless it is the last
            by_id = {r: replica for r, replica in by_id.items() if r not in avoid}
        if pending_request is None or not by_id:
            return [list(by_id.values())] if by_id else []
        # Ray calls again without pause when no rank is taken (all full): back off between tries instead.
        pending_request.routing_context.should_backoff = True
        hashes = pending_request.kwargs.get("routing") or ()
        key = pending_request.kwargs.get("call_id") or pending_request.metadata.internal_request_id
        first, _ = self._chosen.get(key, (None, None))
        loads = self.loads(by_id)
        if first not in by_id:
            # A request is ranked (and, under round-robin, takes its turn) once, not once per try.
            first = self.policy.rank(list(by_id), loads, hashes)[0]
            # Remembered now, not when Ray confirms: requests that share a prefix and arrive together follow the
            # first one instead of racing it.
            self._chosen[key] = (first, self.policy.routed(hashes, first))
            self._reserved[first].append(time.monotonic())
            if len(self._chosen) > MAX_REMEMBERED_CHOICES:
                self._chosen.popitem(last=False)
        rest = sorted((r for r in by_id if r != first), key=lambda r: loads[r])
        return [[by_id[first]]] + [[by_id[r]] for r in rest]

    def loads(self, replicas) -> dict[str, int]:
        """Replica -> its requests in flight plus those ranked onto it and not sent yet."""
        stale = time.monotonic() - RESERVATION_TTL_S
        for replica in replicas:
            reserved = self._reserved.get(replica)
            while reserved and reserved[0] < stale:
                reserved.popleft()
        return {r: self.in_flight[r] + len(self._reserved.get(r, ())) for r in replicas}

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        hashes = pending_request.kwargs.get("routing") or ()
        key = pending_request.kwargs.get("call_id") or pending_request.metadata.internal_request_id
        first, added = self._chosen.pop(key, (None, None))
        if first is not None and first != replica_id.unique_id:
            self.policy.forget_chain(added, first)  # it went elsewhere: what it alone put on `first` is not there
            self._unreserve(first)  # and its place there was never taken by a send
        self.policy.routed(hashes, replica_id.unique_id)

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.in_flight[replica_id.unique_id] += 1
        self._unreserve(replica_id.unique_id)  # Ray names no call here: one reservation there becomes in flight

    def _unreserve(self, replica: str) -> None:
        reserved = self._reserved.get(replica)
        if reserved:
            reserved.popleft()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        key = replica_id.unique_id
        self.in_flight[key] -= 1
        if self.in_flight[key] <= 0:
            del self.in_flight[key]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        gone = set(self.in_flight) | set(self._reserved) | set(self.policy.index.replicas())
        super().update_replicas(replicas)
        for replica in gone - {r.replica_id.unique_id for r in replicas}:
            self._forget(replica)  # scaled down or replaced: its cache went with it

    def _forget(self, replica: str) -> None:
        self.policy.forget(replica)
        self.in_flight.pop(replica, None)
        self._reserved.pop(replica, None)
