"""Scheduling policies at the scheduler level (fake tokens, counted steps): priority order, who preempts whom,
fair share between tenants, and scheduler_delay_factor on an injected clock."""

from __future__ import annotations

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams

EOS = 0


def make_scheduler(policy, num_blocks=100, block_size=4, clock=None, **kw) -> Scheduler:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 64,
                                "scheduling_policy": policy, **kw})
    extra = {"clock": clock} if clock is not None else {}
    return Scheduler(config, KVCacheManager(num_blocks, block_size, False), **extra)


_arrival = iter(range(10**9))


def make_request(request_id, num_prompt=4, max_tokens=8, priority=0, tenant=None, arrival=None) -> Request:
    return Request(request_id, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=frozenset({EOS}), priority=priority, tenant=tenant,
                   arrival_time=float(next(_arrival)) if arrival is None else arrival)


def run_step(sched: Scheduler, token=7):
    out = sched.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
    return out, sched.update_from_output(out, sampled)


def run_to_end(sched: Scheduler, max_steps=10_000) -> list[str]:
    """Step until idle; the request ids in the order they finished."""
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        _, updated = run_step(sched)
        finished += [r.request_id for r in updated if r.is_finished]
    raise AssertionError("did not finish")


def test_priority_policy_admits_by_priority_then_arrival():
    sched = make_scheduler("priority", max_num_seqs=1)
    for rid, prio in (("late-low", 5), ("b", 1), ("a", 0), ("c", 1)):
        sched.add_request(make_request(rid, priority=prio, max_tokens=1))
    assert run_to_end(sched) == ["a", "b", "c", "late-low"]


def test_fcfs_policy_ignores_priority():
    sched = make_scheduler("fcfs", max_num_seqs=1)
    for rid, prio in (("x", 5), ("y", 0)):
        sched.add_request(make_request(rid, priority=prio, max_tokens=1))
    assert run_to_end(sched) == ["x", "y"]


def test_better_request_preempts_the_worst_running_when_the_batch_is_full():
    sched = make_scheduler("priority", max_num_seqs=3)
    lows = [make_request(f"low{i}", priority=10, max_tokens=50) for i in range(3)]
    for r in lows:
        sched.add_request(r)
    run_step(sched)
    urgent = make_request("urgent", priority=0, max_tokens=2)
    sched.add_request(urgent)
    out, _ = run_step(sched)
    # The newest of the worst priority goes; the urgent request gets its prefill (and first token) this step.
    assert out.preempted_request_ids == ["low2"]
    assert urgent.num_output_tokens == 1
    assert [s.request.request_id for s in out.scheduled] == ["urgent", "low0", "low1"]


def test_better_request_preempts_when_blocks_run_out_and_ttft_is_one_step():
    # 12 blocks of 4: four priority-10 requests of 8 tokens hold 8 blocks and grow; priority 0 needs 3 blocks.
    sched = make_scheduler("priority", num_blocks=12, block_size=4)
    lows = [make_request(f"low{i}", num_prompt=8, priority=10, max_tokens=40) for i in range(4)]
    for r in lows:
        sched.add_request(r)
    for _ in range(4):  # each now spans 3 blocks: 12 in use, none free
        run_step(sched)
    assert sched.kv.num_free_blocks == 0
    urgent = make_request("urgent", num_prompt=10, priority=0, max_tokens=3)
    sched.add_request(urgent)
    out, _ = run_step(sched)
    assert urgent.num_output_tokens == 1  # its first token in the first step after it arrived
    assert out.preempted_request_ids[0] == "low3"  # worst priority, newest among equals
    assert all(r.startswith("low") for r in out.preempted_request_ids)
    run_to_end(sched)
    assert all(r.num_output_tokens == 40 for r in lows)  # preempted requests resume without losing a token
    assert sched.kv.num_free_blocks == 12


def test_a_worse_waiting_request_never_preempts_a_better_running_one():
    sched = make_scheduler("priority", max_num_seqs=2)
    good = [make_request(f"good{i}", priority=1, max_tokens=5) for i in range(2)]
    for r in good:
        sched.add_request(r)
    run_step(sched)
    worse = make_request("worse", priority=2, max_tokens=1)
    sched.add_request(worse)
    preempted = []
    while any(not r.is_finished for r in good):
        out, _ = run_step(sched)
        preempted += out.preempted_request_ids
    assert preempted == [] and worse.num_output_tokens == 0
    run_to_end(sched)


def test_out_of_blocks_the_worst_priority_is_preempted_not_the_newest():
    # 6 blocks of 4: three 4-token requests (1 block each) grow to 2 blocks, then 3: somebody must go.
    sched = make_scheduler("priority", num_blocks=6, block_size=4)
    best_but_newest = make_request("best", priority=0, max_tokens=20)
    worst_but_oldest = make_request("worst", priority=9, max_tokens=20)
    mid = make_request("mid", priority=5, max_tokens=20)
    for r in (worst_but_oldest, mid, best_but_newest):
        sched.add_request(r)
    preempted = []
    while not preempted:
        out, _ = run_step(sched)
        preempted = out.preempted_request_ids
    assert preempted == ["worst"]
    run_to_end(sched)


def test_equal_priorities_preempt_the_newest_first():
    sched = make_scheduler("priority", num_blocks=6, block_size=4)
    reqs = [make_request(f"r{i}", priority=3, max_tokens=20) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    preempted = []
    while not preempted:
        out, _ = run_step(sched)
        preempted = out.preempted_request_ids
    assert preempted == ["r2"]
    run_to_end(sched)


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_fair_share_lets_a_small_tenant_finish_before_a_floods_50th(policy):
    sched = make_scheduler(policy, max_num_seqs=4, max_num_batched_tokens=64)
    flood = [make_request(f"A{i}", tenant="A", max_tokens=6, arrival=0.0) for i in range(100)]
    small = [make_request(f"B{i}", tenant="B", max_tokens=6, arrival=0.0) for i in range(5)]
    for r in flood + small:  # A's 100 were queued first
        sched.add_request(r)
    order = run_to_end(sched)
    a50 = order.index("A49")
    last_b = max(order.index(r.request_id) for r in small)
    if policy == "fair":
        assert last_b < a50
    else:
        assert last_b > a50  # the same load under fcfs starves B: the assertion above is not vacuous


def test_fair_share_splits_computed_tokens_evenly_between_active_tenants():
    sched = make_scheduler("fair", max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(40):
        sched.add_request(make_request(f"A{i}", tenant="A", max_tokens=4))
        if i < 20:
            sched.add_request(make_request(f"B{i}", tenant="B", max_tokens=4))
    computed = {"A": 0, "B": 0}
    for _ in range(30):  # B still has work throughout
        out, _ = run_step(sched)
        for s in out.scheduled:
            computed[s.request.tenant] += s.num_tokens
    assert abs(computed["A"] - computed["B"]) <= 0.1 * sum(computed.values())
    run_to_end(sched)


def test_fair_share_does_not_ping_pong_preemptions():
    preemptions = {}
    for policy in ("fcfs", "fair"):  # a pool too small for the batch: both must preempt for memory
        sched = make_scheduler(policy, num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
        for i in range(12):
            sched.add_request(make_request(f"A{i}", num_prompt=8, tenant="A", max_tokens=12))
            sched.add_request(make_request(f"B{i}", num_prompt=8, tenant="B", max_tokens=12))
        run_to_end(sched)
        preemptions[policy] = sched.num_preemptions_total
        assert sched.kv.num_free_blocks == 16
    assert 0 < preemptions["fair"] <= preemptions["fcfs"] + 2


def test_fair_share_preempts_a_tenant_that_holds_the_whole_batch_once_it_is_a_step_ahead():
    sched = make_scheduler("fair", max_num_seqs=2, max_num_batched_tokens=16)
    hogs = [make_request(f"A{i}", tenant="A", max_tokens=60) for i in range(2)]
    for r in hogs:
        sched.add_request(r)
    run_step(sched)
    newcomer = make_request("B0", tenant="B", max_tokens=2)
    sched.add_request(newcomer)
    steps = 0
    while newcomer.num_output_tokens == 0:
        out, _ = run_step(sched)
        steps += 1
    # A gains 2 tokens a step; B must be more than 16 tokens (one step's budget) + its prompt behind.
    assert steps <= (16 + newcomer.num_prompt_tokens) // 2 + 2
    assert out.preempted_request_ids == ["A1"]
    run_to_end(sched)
    assert all(r.num_output_tokens == 60 for r in hogs)


def test_a_tenant_that_comes_back_starts_just_ahead_of_the_others_not_at_zero():
    # A budget of 8 tokens: A's decodes and queued prompts compete for it every step.
    sched = make_scheduler("fair", max_num_batched_tokens=8)
    for i in range(8):
        sched.add_request(make_request(f"A{i}", tenant="A", max_tokens=8))
    for _ in range(3):
        run_step(sched)
    assert len(sched.waiting) > 0
    latecomer = make_request("B0", tenant="B", max_tokens=1)
    sched.add_request(latecomer)
    assert sched.policy.served["B"] == sched.policy.served["A"] - 1 > 0
    out, _ = run_step(sched)
    assert out.scheduled[0].request is latecomer  # ahead of A's running and queued requests, at once
    run_to_end(sched)
    assert sched.policy.served == {}


def test_delay_factor_holds_new_prefills_back_while_requests_run():
    now = [0.0]
    sched = make_scheduler("fcfs", clock=lambda: now[0], scheduler_delay_factor=2.0)
    sched.add_request(make_request("a", max_tokens=20, arrival=0.0))
    run_step(sched)  # nothing running yet: admitted at once
    now[0] = 1.0
    run_step(sched)  # the last step took 1 s
    sched.add_request(make_request("b", max_tokens=2, arrival=1.0))
    now[0] = 2.0  # b has waited 1 s < 2 x 1 s
    out, _ = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    now[0] = 3.0  # b has waited 2 s: admitted
    out, _ = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    run_to_end(sched)


def test_without_delay_factor_a_new_prefill_joins_the_next_step():
    now = [0.0]
    sched = make_scheduler("fcfs", clock=lambda: now[0])
    sched.add_request(make_request("a", max_tokens=5, arrival=0.0))
    run_step(sched)
    sched.add_request(make_request("b", max_tokens=2, arrival=0.0))
    now[0] = 10.0
    out, _ = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    run_to_end(sched)


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_aborting_waiting_and_running_requests_frees_everything(policy):
    sched = make_scheduler(policy, max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", priority=i % 2, tenant=f"t{i % 2}"))
    run_step(sched)
    sched.finish_requests([f"r{i}" for i in range(5)], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and len(sched.waiting) == 0
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, fair"):
        SchedulerConfig(scheduling_policy="lottery")
