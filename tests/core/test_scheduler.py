import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks=100, block_size=4, prefix_caching=False, **kw) -> Scheduler:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 64, **kw})
    return Scheduler(config, KVCacheManager(num_blocks, block_size, prefix_caching))


def make_request(request_id, num_prompt, max_tokens=8, **params) -> Request:
    return Request(request_id, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=frozenset({EOS}))


def run_step(sched: Scheduler, token=7):
    out = sched.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
    return out, sched.update_from_output(out, sampled)


def test_decodes_are_scheduled_before_new_prefills():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    run_step(sched)
    sched.add_request(make_request("b", 30))
    out = sched.schedule()
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 30)]


def test_token_budget_chunks_long_prompts_and_resumes_them():
    sched = make_scheduler(max_num_batched_tokens=10)
    req = make_request("a", 25)
    sched.add_request(req)
    chunks = []
    while req.num_output_tokens == 0:
        out, _ = run_step(sched)
        chunks.append(out.scheduled[0].num_tokens)
    assert chunks == [10, 10, 5]
    assert req.num_computed_tokens == 25


def scheduled(out):
    return [(s.request.request_id, s.num_tokens) for s in out.scheduled]


def run_step_counting_prefill(sched: Scheduler):
    """One step; the tokens it gave to requests that had more than one token to compute (prefills)."""
    out = sched.schedule()
    prefill = sum(s.num_tokens for s in out.scheduled if s.request.num_tokens - s.request.num_computed_tokens > 1)
    sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
    return out, prefill


def test_max_prefill_tokens_prefills_prompts_that_arrive_together_a_few_at_a_time():
    sched = make_scheduler(max_num_batched_tokens=64, max_prefill_tokens=10)
    for rid in "abc":
        sched.add_request(make_request(rid, 6))
    first, _ = run_step(sched)
    assert scheduled(first) == [("a", 6), ("b", 4)]  # b's prompt chunked at the cap
    second, _ = run_step(sched)
    assert scheduled(second) == [("a", 1), ("b", 2), ("c", 6)]  # a decodes outside the cap
    third, _ = run_step(sched)
    assert scheduled(third) == [("a", 1), ("b", 1), ("c", 1)]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_max_prefill_tokens_caps_each_steps_prompt_tokens_under_every_policy_and_changes_no_token(policy):
    def run(cap):
        sched = make_scheduler(num_blocks=200, max_num_batched_tokens=48, max_prefill_tokens=cap,
                               scheduling_policy=policy)
        requests = [make_request(str(i), 5 + 3 * i, max_tokens=4 + i) for i in range(6)]
        for r in requests:
            sched.add_request(r)
        prefill_per_step = []
        while sched.has_unfinished_requests():
            prefill_per_step.append(run_step_counting_prefill(sched)[1])
        assert sched.kv.num_free_blocks == 200
        return [r.output_token_ids for r in requests], prefill_per_step

    capped, steps_capped = run(7)
    uncapped, steps_uncapped = run(None)
    assert capped == uncapped
    assert max(steps_capped) == 7 < max(steps_uncapped)
    assert sum(steps_capped) == sum(steps_uncapped) == sum(5 + 3 * i for i in range(6))


def test_max_prefill_tokens_applies_to_recompute_after_preemption():
    sched = make_scheduler(num_blocks=5, block_size=4, max_prefill_tokens=4)
    a, b = make_request("a", 8, max_tokens=10), make_request("b", 8, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    prefill_per_step = []
    while sched.has_unfinished_requests():
        prefill_per_step.append(run_step_counting_prefill(sched)[1])
    assert b.num_preemptions >= 1 and max(prefill_per_step) == 4
    assert a.num_output_tokens == 10 and b.num_output_tokens == 10
    assert sched.kv.num_free_blocks == 5


def test_max_prefill_tokens_is_checked():
    with pytest.raises(ValueError, match="max_prefill_tokens must be >= 1"):
        SchedulerConfig(max_prefill_tokens=0)
    with pytest.raises(ValueError, match="max_prefill_tokens needs chunked prefill"):
        SchedulerConfig(max_prefill_tokens=256, enable_chunked_prefill=False)


def test_without_chunked_prefill_a_prompt_over_budget_waits_for_budget():
    sched = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 8))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a"]


def test_max_num_seqs_caps_the_batch():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(str(i), 2))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and sched.num_waiting == 1


def test_preemption_frees_newest_and_it_resumes_first():
    # 5 blocks of 4 tokens: two requests of 8 prompt tokens take 4 blocks; growing both needs 6.
    sched = make_scheduler(num_blocks=5, block_size=4)
    a, b = make_request("a", 8, max_tokens=10), make_request("b", 8, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # both prefilled, each has 1 output token -> 9 tokens
    out, _ = run_step(sched)  # a needs a 3rd block (1 left), b needs one too -> b is preempted
    assert out.preempted_request_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.waiting[0] is b and b.num_preemptions == 1
    assert sched.num_preemptions_total == 1
    while sched.has_unfinished_requests():
        run_step(sched)
    assert a.num_output_tokens == 10 and b.num_output_tokens == 10
    assert sched.kv.num_free_blocks == 5


def test_stop_conditions_eos_stop_token_and_length():
    sched = make_scheduler()
    eos_req = make_request("eos", 3)
    stop_req = make_request("stop", 3, stop_token_ids=[7])
    sched.add_request(eos_req)
    sched.add_request(stop_req)
    out = sched.schedule()
    sched.update_from_output(out, {"eos": EOS, "stop": 7})
    assert eos_req.status == RequestStatus.FINISHED_STOPPED and eos_req.stop_reason is None
    assert stop_req.status == RequestStatus.FINISHED_STOPPED and stop_req.stop_reason == 7
    length_req = make_request("len", 3, max_tokens=2)
    sched.add_request(length_req)
    run_step(sched)
    run_step(sched)
    assert length_req.status == RequestStatus.FINISHED_LENGTH
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_min_tokens_and_ignore_eos_keep_generating_after_eos():
    sched = make_scheduler()
    req = make_request("a", 3, min_tokens=2)
    ign = make_request("b", 3, ignore_eos=True)
    sched.add_request(req)
    sched.add_request(ign)
    run_step(sched, token=EOS)
    assert not req.is_finished and not ign.is_finished
    run_step(sched, token=EOS)
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert not ign.is_finished


def test_generation_stops_at_max_model_len():
    sched = make_scheduler(max_model_len=6)
    req = make_request("a", 4, max_tokens=None)
    sched.add_request(req)
    while sched.has_unfinished_requests():
        run_step(sched)
    assert req.num_tokens == 6 and req.status == RequestStatus.FINISHED_LENGTH


def test_prompts_that_can_never_fit_are_rejected_at_once():
    sched = make_scheduler(max_model_len=10)
    with pytest.raises(ValueError, match="10 tokens.*max_model_len=10"):
        sched.add_request(make_request("a", 10))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("b", 0))
    assert not sched.has_unfinished_requests()


def test_abort_frees_blocks_of_running_and_waiting_requests():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 5))
    sched.add_request(make_request("b", 5))
    out = sched.schedule()
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    sched.update_from_output(out, {"a": 7})  # the step that was in flight is ignored for aborted requests
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sorted(sched.schedule().finished_request_ids) == ["a", "b"]
