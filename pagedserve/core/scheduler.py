"""Continuous batching: every step hands out tokens under a budget, decodes first, then (chunked) prefills.

There is no prefill or decode phase. Each request only knows how many of its tokens exist and how many are
computed; a step computes some of the difference. Prefill, chunked prefill, decode and recompute after
preemption are the same thing seen from here.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Iterable, Optional

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler_output import ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: list[str] = []
        self.num_preemptions_total = 0

    # -- admission -------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; reject at once one that could never run to completion."""
        limit = self.config.max_model_len
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id}: the prompt is empty")
        if request.num_prompt_tokens >= limit:
            raise ValueError(
                f"request {request.request_id}: prompt has {request.num_prompt_tokens} tokens, which leaves no room "
                f"to generate within max_model_len={limit}")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    # -- one step --------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        budget = self.config.max_num_batched_tokens

        # Running requests first, oldest first; when blocks run out, preempt the newest.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._allocate_or_preempt(request, num_new, out):
                out.scheduled.append(ScheduledRequest(request, num_new, self.kv.get_block_ids(request.request_id)))
                budget -= num_new
                i += 1

        # Then waiting requests, in order, unless this step already had to preempt (memory is tight).
        while (self.waiting and budget > 0 and not out.preempted_request_ids
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            # Waiting requests have no KV (new, or preempted); their leading blocks may be in the cache.
            computed_blocks = self.kv.get_computed_blocks(request)
            num_cached = len(computed_blocks) * self.kv.block_size
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            request.num_computed_tokens = num_cached
            if not self.kv.allocate_slots(request, num_new, computed_blocks):
                request.num_computed_tokens = 0
                break
            self.kv.record_prefix_lookup(request.num_tokens, num_cached)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
                request.num_cached_tokens = num_cached
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new, self.kv.get_block_ids(request.request_id)))
            budget -= num_new
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate slots for `request`, preempting the newest running requests until it fits.
        Returns False when `request` itself had to be preempted."""
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        # Preemption by recompute: drop the KV, keep the tokens; it resumes from the front of the queue.
        self.kv.free(request, keep_hashes=True)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests by the step's result: `sampled` maps each request that sampled to
        its new token. Returns the requests that got a new token (finished ones included)."""
        updated = []
        for item in out.scheduled:
            request = item.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += item.num_tokens
            self.kv.cache_blocks(request)
            token_id = sampled.get(request.request_id)
            if token_id is None:  # a prefill chunk that does not reach the end of the prompt yet
                continue
            request.append_output_token(token_id)
            status = self._stop_status(request, token_id)
            if status is not None:
                self._finish(request, status)
            updated.append(request)
        self.running = [r for r in self.running if not r.is_finished]
        return updated

    def _stop_status(self, request: Request, token_id: int) -> Optional[RequestStatus]:
        params = request.sampling_params
        if token_id in request.stop_token_ids and request.num_output_tokens >= params.min_tokens:
            request.stop_reason = token_id if token_id in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if request.max_tokens is not None and request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- finishing from outside (abort, stop strings) -------------------------------------------------

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus,
                        stop_reason: Optional[str] = None) -> None:
        """Finish requests now (abort, or a stop string seen by the front end); unknown ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.stop_reason = stop_reason
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        # The caller takes the request out of its queue.
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_since_last_step.append(request.request_id)

    # -- state -----------------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
