"""Continuous batching: every step hands out tokens under a budget, decodes first, then (chunked) prefills.

There is no prefill or decode phase. Each request only knows how many of its tokens exist and how many are
computed; a step computes some of the difference. Prefill, chunked prefill, decode and recompute after
preemption are the same thing seen from here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestIdInUseError, RequestStatus
from pagedserve.core.sched_policy import make_policy
from pagedserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from pagedserve.lora.slots import SlotTable


@dataclass
class StepBudget:
    """The tokens a step may still hand out: in all, and of those to prefills (max_prefill_tokens). A request
    with more than one token to compute is prefilling (a prompt, or recompute after preemption); a decode
    computes one."""

    tokens: int
    prefill_tokens: int

    def grant(self, to_compute: int) -> int:
        """How many of a request's `to_compute` tokens this step can take."""
        return min(to_compute, self.tokens if to_compute == 1 else min(self.tokens, self.prefill_tokens))

    def spend(self, granted: int, to_compute: int) -> None:
        self.tokens -= granted
        if to_compute > 1:
            self.prefill_tokens -= granted


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 clock: Callable[[], float] = time.time, max_loras: int = 0) -> None:
        """`max_loras` > 0 turns on LoRA: at most that many distinct adapters among the running requests."""
        self.config = config
        self.kv = kv_cache_manager
        self.policy = make_policy(config.scheduling_policy, config.max_num_batched_tokens)
        self.waiting = self.policy.new_waiting_queue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: list[str] = []
        self.num_preemptions_total = 0
        self._clock = clock
        self._last_schedule_time: Optional[float] = None
        self._last_step_duration = 0.0
        self.lora_slots: Optional[SlotTable] = SlotTable(max_loras) if max_loras else None

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
            raise RequestIdInUseError(request.request_id)
        self.requests[request.request_id] = request
        self.policy.on_add(request)
        self.waiting.push(request)

    # -- one step --------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        admit = self._admission_open()
        if self.policy.preemptive:
            self._schedule_by_key(out, admit)
        else:
            self._schedule_fcfs(out, admit)
        if self.lora_slots is not None:
            used = {s.request.lora_generation for s in out.scheduled}
            out.lora_slots = {g: slot for g, slot in self.lora_slots.active().items() if g in used}
        return out

    def _admission_open(self) -> bool:
        """scheduler_delay_factor: while requests run, hold new prefills back until the oldest waiting request
        has waited factor x the last step's duration, so that arrivals close together share a step."""
        now = self._clock()
        if self._last_schedule_time is not None:
            self._last_step_duration = now - self._last_schedule_time
        self._last_schedule_time = now
        factor = self.config.scheduler_delay_factor
        if factor <= 0 or not self.running or not len(self.waiting):
            return True
        oldest = min(r.arrival_time for r in self.waiting)
        return now - oldest >= factor * self._last_step_duration

    def _new_budget(self) -> StepBudget:
        tokens, cap = self.config.max_num_batched_tokens, self.config.max_prefill_tokens
        return StepBudget(tokens, tokens if cap is None else cap)

    def _schedule_fcfs(self, out: SchedulerOutput, admit: bool) -> None:
        budget = self._new_budget()
        # Running requests first, oldest first; when blocks run out, preempt the newest.
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            if self._schedule_running(self.running[i], budget, out):
                i += 1
        # Then waiting requests, in order, unless this step already had to preempt (memory is tight). One
        # whose LoRA adapter can get no slot, or whose grammar is still compiling, is passed over (it stays
        # first in line); those behind it may run.
        passed = 0
        while (admit and budget.tokens > 0 and not out.preempted_request_ids
               and len(self.running) < self.config.max_num_seqs):
            passed = self._first_admissible(passed)
            if passed == len(self.waiting) or not self._try_admit(self.waiting[passed], budget, out):
                break
            self.running.append(self.waiting.pop_at(passed))

    def _schedule_by_key(self, out: SchedulerOutput, admit: bool) -> None:
        """Running and waiting requests in one walk in key order (running first among equals); a waiting
        request that finds no blocks or no batch slot preempts the running requests that sort after it."""
        key = self.policy.key
        self.policy.before_schedule(self.waiting)
        self.running.sort(key=key)
        budget, i, admitted, passed = self._new_budget(), 0, [], 0
        while budget.tokens > 0:
            # Waiting requests that cannot start yet (LoRA slot, grammar) are passed over, as under fcfs.
            passed = self._first_admissible(passed) if admit else passed
            head = self.waiting[passed] if admit and passed < len(self.waiting) else None
            if i < len(self.running) and (head is None or not key(head) < key(self.running[i])):
                if self._schedule_running(self.running[i], budget, out):
                    i += 1
                continue
            if head is None:
                break
            if head.request_id in out.preempted_request_ids:
                admit = False  # nothing better left to admit than what this step had to preempt
                continue
            if not self._admit_preempting(head, budget, out, first_unscheduled=i, num_admitted=len(admitted)):
                admit = False
                continue
            admitted.append(self.waiting.pop_at(passed))
        self.running.extend(admitted)

    def _first_admissible(self, start: int) -> int:
        """The index of the first waiting request from `start` on that can start now: its adapter (if any) can
        get a LoRA slot and its grammar (if any) is compiled; len(waiting) when there is none."""
        while start < len(self.waiting) and not (self.waiting[start].grammar_ready
                                                 and self._lora_slot_free(self.waiting[start])):
            start += 1
        return start

    def _lora_slot_free(self, request: Request) -> bool:
        generation = request.lora_generation
        return self.lora_slots is None or generation is None or self.lora_slots.can_acquire(generation)

    def _schedule_running(self, request: Request, budget: StepBudget, out: SchedulerOutput) -> bool:
        """Schedule a running request's next tokens, if the budget has any for it (a prefill may find the
        step's prefill tokens spent: it waits a step); False when it was preempted."""
        to_compute = request.num_tokens - request.num_computed_tokens
        num_new = budget.grant(to_compute)
        if num_new == 0:
            return True
        if not self._allocate_or_preempt(request, num_new, out):
            return False
        out.scheduled.append(ScheduledRequest(request, num_new, self.kv.get_block_ids(request.request_id)))
        budget.spend(num_new, to_compute)
        return True

    def _admit_preempting(self, request: Request, budget: StepBudget, out: SchedulerOutput, first_unscheduled: int,
                          num_admitted: int) -> bool:
        """Admit a waiting request, preempting running requests it may preempt (worst first, never one
        already scheduled this step) while it finds no room. False when it was not admitted."""
        num_new = self._prefill_size(request)[2]
        if budget.grant(num_new) < (1 if self.config.enable_chunked_prefill else num_new):
            return False  # preempting frees blocks and slots, not this step's token budget
        while True:
            if len(self.running) + num_admitted < self.config.max_num_seqs and self._try_admit(request, budget, out):
                return True
            if len(self.running) <= first_unscheduled or not self.policy.may_preempt(request, self.running[-1]):
                return False
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)

    def _try_admit(self, request: Request, budget: StepBudget, out: SchedulerOutput) -> bool:
        """Give a waiting request (no KV: new, or preempted) its first chunk; False when it does not fit.
        The caller moves it from the waiting queue to the running batch."""
        computed_blocks, num_cached, to_compute = self._prefill_size(request)
        num_new = budget.grant(to_compute)
        if num_new == 0 or (num_new < to_compute and not self.config.enable_chunked_prefill):
            return False
        request.num_computed_tokens = num_cached
        if not self.kv.allocate_slots(request, num_new, computed_blocks):
            request.num_computed_tokens = 0
            return False
        self.kv.record_prefix_lookup(request.num_tokens, num_cached)
        if self.lora_slots is not None and request.lora_generation is not None:
            self.lora_slots.acquire(request.lora_generation)  # the caller checked _lora_slot_free
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
            request.num_cached_tokens = num_cached
        out.scheduled.append(ScheduledRequest(request, num_new, self.kv.get_block_ids(request.request_id)))
        budget.spend(num_new, to_compute)
        return True

    def _prefill_size(self, request: Request) -> tuple[list[int], int, int]:
        """A waiting request's cached leading blocks, their tokens, and the tokens left to compute."""
        computed_blocks = self.kv.get_computed_blocks(request)
        num_cached = len(computed_blocks) * self.kv.block_size
        return computed_blocks, num_cached, request.num_tokens - num_cached

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate slots for `request`, preempting the last running requests (the newest, or under a keyed
        policy the worst) until it fits. Returns False when `request` itself had to be preempted."""
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        # Preemption by recompute: drop the KV, keep the tokens; it resumes from the front of the queue
        # (under a keyed policy: where its key puts it).
        self.kv.free(request, keep_hashes=True)
        self._release_lora_slot(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.push_front(request)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests by the step's result: `sampled` maps each request that sampled to
        its new token. Returns the requests that got a new token (finished ones included)."""
        updated = []
        for item in out.scheduled:
            request = item.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += item.num_tokens
            self.policy.on_computed(request, item.num_tokens)
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
        if request.status == RequestStatus.RUNNING:
            self._release_lora_slot(request)
        request.status = status
        self.kv.free(request)
        self.policy.on_finish(request)
        del self.requests[request.request_id]
        self._finished_since_last_step.append(request.request_id)

    def _release_lora_slot(self, request: Request) -> None:
        """A running request stops holding its adapter's slot (preempted or finished)."""
        if self.lora_slots is not None and request.lora_generation is not None:
            self.lora_slots.release(request.lora_generation)

    # -- state -----------------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
