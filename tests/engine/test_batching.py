"""Batching, chunking and preemption never change a request's greedy result; nothing leaks."""

import random

import pytest

from conftest import assert_no_leaked_blocks, build_tiny_model
from pagedserve import LLM, SamplingParams
from pagedserve.kernels import build, skinny_gemm

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=256)


def prompts(n, seed=0, lo=1, hi=120):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 390) for _ in range(rng.randint(lo, hi))]} for _ in range(n)]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_request_result_is_the_same_alone_and_among_50_others(llm):
    target = prompts(1, seed=42, lo=60, hi=60)[0]
    alone = token_ids(llm.generate(target, GREEDY, use_tqdm=False))[0]
    others = prompts(50, seed=1)
    mixed = token_ids(llm.generate(others[:25] + [target] + others[25:], GREEDY, use_tqdm=False))
    assert mixed[25] == alone
    assert_no_leaked_blocks(llm.engine)


def test_chunked_prefill_gives_the_same_result(tiny_llama_dir, llm):
    batch = prompts(6, seed=3, lo=40, hi=110)
    expected = token_ids(llm.generate(batch, GREEDY, use_tqdm=False))
    chunked = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=7)
    assert token_ids(chunked.generate(batch, GREEDY, use_tqdm=False)) == expected
    assert_no_leaked_blocks(chunked.engine)


def test_max_prefill_tokens_gives_the_same_results_and_caps_every_steps_prompt_tokens(tiny_llama_dir, llm):
    batch = prompts(8, seed=4, lo=20, hi=90)
    expected = token_ids(llm.generate(batch, GREEDY, use_tqdm=False))
    capped = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=256,
                 max_prefill_tokens=24)
    scheduler, prefill_per_step = capped.engine.scheduler, []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        prefill_per_step.append(sum(s.num_tokens for s in out.scheduled
                                    if s.request.num_tokens - s.request.num_computed_tokens > 1))
        return out

    scheduler.schedule = recording_schedule
    assert token_ids(capped.generate(batch, GREEDY, use_tqdm=False)) == expected
    assert max(prefill_per_step) == 24
    assert sum(prefill_per_step) == sum(len(p["prompt_token_ids"]) for p in batch)
    assert_no_leaked_blocks(capped.engine)


def test_preemption_with_a_tiny_pool_gives_the_same_results(tiny_llama_dir, llm):
    batch = prompts(20, seed=5, lo=5, hi=40)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = token_ids(llm.generate(batch, params, use_tqdm=False))
    # 12 blocks of 16 tokens hold about 3 of these sequences at once; 20 run, so the scheduler must preempt.
    small = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=12 * small_block_bytes(llm),
                max_model_len=128)
    assert small.engine.kv_cache_manager.num_blocks == 12
    outputs = small.generate(batch, params, use_tqdm=False)
    assert token_ids(outputs) == expected
    assert small.engine.scheduler.num_preemptions_total > 0
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert_no_leaked_blocks(small.engine)


@pytest.fixture(scope="module")
def head_dim_64_dir(tmp_path_factory):
    """head_dim 64 (4 heads over 2 KV heads): a shape the CPU attention kernel computes prompts for in tiles."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama_hd64")), "llama", hidden_size=256,
                            intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def test_bf16_prompt_tiles_chunking_and_preemption_give_the_same_results(head_dim_64_dir):
    """In bfloat16 a prompt's tokens go through the attention kernel's tiles, a decode's alone; chunks of 7
    tokens (tiles of up to 7) and recomputation after preemption (tiles over prompt and generated tokens) must
    give every request the tokens and logprobs of one unchunked run."""
    if not skinny_gemm.takes_every_batch():
        pytest.skip(f"bf16 rows are batch-invariant only where the packed matmul takes every batch (avx512_bf16, "
                    f"unless torch's AMX matmuls measure faster); at the {build.cpu_isa()} level here torch's BLAS "
                    f"computes large batches")
    batch = prompts(12, seed=9, lo=20, hi=90)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    common = dict(dtype="bfloat16", max_model_len=128)
    whole = LLM(head_dim_64_dir, **common, kv_cache_memory_bytes=1 << 24)
    expected = whole.generate(batch, params, use_tqdm=False)
    chunked = LLM(head_dim_64_dir, **common, kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=7)
    small = LLM(head_dim_64_dir, **common, kv_cache_memory_bytes=10 * small_block_bytes(whole))
    for engine in (chunked, small):
        outputs = engine.generate(batch, params, use_tqdm=False)
        assert token_ids(outputs) == token_ids(expected)
        assert [o.outputs[0].logprobs for o in outputs] == [o.outputs[0].logprobs for o in expected]
        assert_no_leaked_blocks(engine.engine)
    assert small.engine.scheduler.num_preemptions_total > 0


def small_block_bytes(llm) -> int:
    return llm.engine.runner.bytes_per_block


def test_max_model_len_that_does_not_fit_the_cache_is_an_error(tiny_llama_dir, llm):
    with pytest.raises(ValueError, match="needs more KV cache"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=4 * small_block_bytes(llm), max_model_len=128)


def test_chunked_prefill_off_needs_a_budget_of_a_whole_sequence(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_num_batched_tokens=64 is smaller than max_model_len=128"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=128,
            max_num_batched_tokens=64, enable_chunked_prefill=False)
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=128,
              max_num_batched_tokens=128, enable_chunked_prefill=False)
    outs = llm.generate(prompts(4, seed=21, lo=100, hi=120), GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert_no_leaked_blocks(llm.engine)


def test_too_long_prompt_is_rejected_and_nothing_is_queued(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32"):
        llm.generate([{"prompt_token_ids": [5] * 10}, {"prompt_token_ids": [5] * 40}], GREEDY, use_tqdm=False)
    assert_no_leaked_blocks(llm.engine)


def test_token_ids_in_params_outside_the_vocabulary_are_rejected(llm):
    with pytest.raises(ValueError, match="stop_token_ids has token ids outside the vocabulary"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias has token ids outside the vocabulary"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def test_bad_prompt_token_ids_are_rejected(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate({"prompt_token_ids": [1, 10**9]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    assert_no_leaked_blocks(llm.engine)


def test_abort_mid_generation_frees_every_block(llm):
    engine = llm.engine
    for i, p in enumerate(prompts(6, seed=9)):
        engine.add_request(f"abort-{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.kv_cache_manager.num_blocks
    engine.abort_request([f"abort-{i}" for i in range(6)])
    assert_no_leaked_blocks(engine)
    assert engine.step() == []


def test_n_samples_come_back_together_in_one_output(llm):
    [out] = llm.generate(prompts(1, seed=11)[0], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8),
                         use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per child
    assert_no_leaked_blocks(llm.engine)


def test_outputs_come_back_in_input_order_with_timings(llm):
    batch = prompts(5, seed=13)
    outs = llm.generate(batch, [SamplingParams(temperature=0, max_tokens=i + 1, ignore_eos=True) for i in range(5)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in batch]
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time
        assert o.outputs[0].finish_reason == "length"


def test_aborting_some_requests_mid_batch_leaves_the_others_unchanged(llm):
    batch = prompts(10, seed=17, lo=5, hi=60)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = token_ids(llm.generate(batch, params, use_tqdm=False))
    engine = llm.engine
    for i, p in enumerate(batch):
        engine.add_request(f"mix-{i}", p, params)
    finished = {}
    for step in range(200):
        if step == 4:
            engine.abort_request([f"mix-{i}" for i in range(0, 10, 2)])
        for out in engine.step():
            finished[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert sorted(finished) == sorted(f"mix-{i}" for i in range(1, 10, 2))
    for i in range(1, 10, 2):
        assert finished[f"mix-{i}"] == expected[i]
    assert_no_leaked_blocks(engine)
