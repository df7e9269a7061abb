"""The priority and fair policies through the engine on a tiny model: a better request starts within a step of
arriving, preempted work resumes, tenants share the engine, and no policy changes any request's greedy result."""

from __future__ import annotations

import random

import pytest

from conftest import assert_no_leaked_blocks
from pagedserve import LLM, SamplingParams


def prompts(n, seed, lo=8, hi=30):
    rng = random.Random(seed)
    return [[rng.randrange(3, 390) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def params(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=128)


def alone(reference, prompt, max_tokens):
    [out] = reference.generate({"prompt_token_ids": prompt}, params(max_tokens), use_tqdm=False)
    return out.outputs[0].token_ids


def small_llm(tiny_llama_dir, reference, policy, num_blocks=12, **kw):
    block_bytes = reference.engine.runner.bytes_per_block
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=num_blocks * block_bytes, max_model_len=128,
               scheduling_policy=policy, **kw)


def step_until(engine, done, tokens, limit=500) -> dict:
    """Step until done(finished outputs so far) is true; request id -> finished output. Streamed requests'
    deltas are added to `tokens` (request id -> token ids)."""
    finished = {}
    for _ in range(limit):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                finished[out.request_id] = out
        if done(finished):
            return finished
    raise AssertionError("not done")


def test_urgent_request_starts_within_a_step_on_a_full_pool_and_nothing_changes(tiny_llama_dir, reference):
    llm = small_llm(tiny_llama_dir, reference, "priority")
    engine = llm.engine
    low = prompts(6, seed=1, lo=20, hi=30)
    for i, p in enumerate(low):
        engine.add_request(f"low{i}", {"prompt_token_ids": p}, params(40), priority=10)
    for _ in range(6):  # the low-priority work now fills the 12-block pool
        engine.step()
    assert engine.kv_cache_manager.num_free_blocks <= 2
    urgent = prompts(1, seed=2, lo=30, hi=30)[0]
    engine.add_request("urgent", {"prompt_token_ids": urgent}, params(3), priority=0, stream=True)
    first_step = [o for o in engine.step() if o.request_id == "urgent"]
    assert first_step and first_step[0].outputs[0].token_ids  # its first token from the first step after it came
    assert engine.scheduler.num_preemptions_total > 0
    streamed = {"urgent": list(first_step[0].outputs[0].token_ids)}
    finished = step_until(engine, lambda f: len(f) == 7, streamed)
    assert finished["urgent"].metrics.finished_time < min(o.metrics.finished_time for k, o in finished.items()
                                                          if k != "urgent")
    assert streamed["urgent"] == alone(reference, urgent, 3)
    for i, p in enumerate(low):
        assert finished[f"low{i}"].outputs[0].token_ids == alone(reference, p, 40)
    assert_no_leaked_blocks(engine)


def test_priority_list_orders_an_offline_batch_and_keeps_results(tiny_llama_dir, reference):
    llm = small_llm(tiny_llama_dir, reference, "priority", num_blocks=64, max_num_seqs=1)
    batch = prompts(4, seed=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params(4), use_tqdm=False,
                           priority=[3, 0, 2, 1])
    finish_order = sorted(range(4), key=lambda i: outputs[i].metrics.finished_time)
    assert finish_order == [1, 3, 2, 0]
    assert [o.outputs[0].token_ids for o in outputs] == [alone(reference, p, 4) for p in batch]


def test_priority_needs_a_priority_policy_and_one_value_per_prompt(tiny_llama_dir, reference):
    with pytest.raises(ValueError, match="priority 1 needs scheduling_policy"):
        reference.generate([[5, 6]], params(2), use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        reference.generate([[5, 6]], params(2), use_tqdm=False, priority=[0, 0])
    assert reference.generate([[5, 6]], params(2), use_tqdm=False, priority=[0])  # 0 is every policy's default
    assert_no_leaked_blocks(reference.engine)


def test_fair_policy_finishes_a_small_tenant_before_a_floods_50th_with_unchanged_results(tiny_llama_dir, reference):
    llm = small_llm(tiny_llama_dir, reference, "fair", num_blocks=64, max_num_seqs=4)
    engine = llm.engine
    flood, small = prompts(100, seed=4, lo=4, hi=12), prompts(5, seed=5, lo=4, hi=12)
    for i, p in enumerate(flood):
        engine.add_request(f"A{i}", {"prompt_token_ids": p}, params(4), tenant="A")
    for i, p in enumerate(small):
        engine.add_request(f"B{i}", {"prompt_token_ids": p}, params(4), tenant="B")
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert max(order.index(f"B{i}") for i in range(5)) < order.index("A49")
    assert_no_leaked_blocks(engine)


def test_tenant_must_be_a_string(reference):
    with pytest.raises(ValueError, match="tenant must be a string"):
        reference.engine.add_request("x", [5, 6], params(2), tenant=7)
