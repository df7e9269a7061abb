"""The scheduler with LoRA slots (fake tokens, counted steps): at most max_loras distinct adapters run at
once; a waiting request whose adapter gets no slot is passed over, under every policy, and the requests
behind it still run; slots come back when requests finish or are preempted."""

from __future__ import annotations

import itertools

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams

POLICIES = ["fcfs", "priority", "fair"]
_arrival = itertools.count()


def make_scheduler(policy="fcfs", max_loras=1, num_blocks=100, **kw) -> Scheduler:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 64,
                                "scheduling_policy": policy, **kw})
    return Scheduler(config, KVCacheManager(num_blocks, 4, False), max_loras=max_loras)


def make_request(request_id, adapter=None, max_tokens=3, num_prompt=4) -> Request:
    """A request of adapter load `adapter` (an int generation, as the core binds it), None for the base model."""
    lora = None if adapter is None else LoRARequest(f"adapter-{adapter}", adapter, "/unused")
    request = Request(request_id, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=max_tokens),
                      arrival_time=float(next(_arrival)), lora_request=lora)
    request.lora_generation = adapter
    return request


def step(sched: Scheduler):
    out = sched.schedule()
    sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
    return out


def scheduled_ids(out) -> set[str]:
    return {s.request.request_id for s in out.scheduled}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_whose_adapter_has_no_slot_is_passed_over_and_those_behind_it_run(policy):
    sched = make_scheduler(policy, max_loras=1)
    for request in (make_request("a1", 1), make_request("b", 2), make_request("base", None),
                    make_request("a2", 1)):
        sched.add_request(request)
    first = step(sched)
    assert scheduled_ids(first) == {"a1", "base", "a2"}
    assert first.lora_slots == {1: 0}
    assert [r.request_id for r in sched.waiting] == ["b"]
    steps_until_b = 1
    while "b" not in scheduled_ids(step(sched)):
        steps_until_b += 1
    assert steps_until_b == 3  # a1 and a2 finish after 3 steps (max_tokens=3); then b gets the slot


@pytest.mark.parametrize("policy", POLICIES)
def test_never_more_distinct_adapters_run_than_max_loras(policy):
    sched = make_scheduler(policy, max_loras=2)
    for i in range(12):
        sched.add_request(make_request(f"r{i}", i % 5 + 1 if i % 4 else None, max_tokens=1 + i % 3))
    steps = 0
    while sched.has_unfinished_requests():
        out = step(sched)
        running_adapters = {r.lora_generation for r in sched.running} - {None}
        assert len(running_adapters) <= 2 and len(out.lora_slots) <= 2
        assert set(out.lora_slots) == {s.request.lora_generation for s in out.scheduled} - {None}
        steps += 1
        assert steps < 100
    assert sched.lora_slots.active() == {}


def test_a_preempted_request_gives_its_slot_back():
    # 5 blocks of 4 tokens: two 8-token prompts take 4; growing both needs 6, so the newer one is preempted.
    sched = make_scheduler(max_loras=2, num_blocks=5)
    sched.add_request(make_request("a", 1, max_tokens=10, num_prompt=8))
    sched.add_request(make_request("b", 2, max_tokens=10, num_prompt=8))
    step(sched)
    out = step(sched)
    assert out.preempted_request_ids == ["b"]
    assert sched.lora_slots.active() == {1: sched.lora_slots.slot_of(1)}
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.lora_slots.active() == {}


def test_aborting_a_running_request_releases_its_slot_and_a_waiting_one_holds_none():
    sched = make_scheduler(max_loras=1)
    sched.add_request(make_request("a", 1, max_tokens=10))
    sched.add_request(make_request("b", 2, max_tokens=10))
    step(sched)
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)  # waiting: nothing to release
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.lora_slots.active() == {}
    assert not sched.has_unfinished_requests()


def test_without_lora_the_scheduler_has_no_slots_and_sends_no_assignment():
    sched = make_scheduler(max_loras=0)
    sched.add_request(make_request("base"))
    assert sched.lora_slots is None and step(sched).lora_slots == {}
