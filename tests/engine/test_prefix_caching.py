"""Prefix caching through the whole engine: outputs never change when the cache hits; tenants never share."""

import random

import pytest

from conftest import assert_no_leaked_blocks
from pagedserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def shared_prefix_prompts(n=100, seed=0):
    """Requests in groups that share prefixes of many lengths, block-aligned (16, 32, 48) and not."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 390) for _ in range(length)] for length in (5, 16, 23, 32, 41, 48, 70)]
    prompts = []
    for i in range(n):
        prefix = prefixes[i % len(prefixes)]
        suffix = [rng.randrange(3, 390) for _ in range(rng.randint(0, 12))]
        prompts.append({"prompt_token_ids": prefix + suffix if suffix or len(prefix) > 1 else prefix + [7]})
    return prompts


def make_llm(tiny_llama_dir, **kw):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=kw.pop("kv", 1 << 24), **kw)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    off = make_llm(tiny_llama_dir, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in off.generate(shared_prefix_prompts(), GREEDY, use_tqdm=False)]


def test_outputs_with_caching_equal_outputs_without(tiny_llama_dir, expected):
    on = make_llm(tiny_llama_dir, max_num_batched_tokens=64, max_num_seqs=8)  # small batches: later ones hit
    outputs = on.generate(shared_prefix_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    kv = on.engine.kv_cache_manager
    assert kv.prefix_cache_hits > 0 and kv.prefix_cache_queries >= kv.prefix_cache_hits
    assert sum(o.num_cached_tokens for o in outputs) == kv.prefix_cache_hits
    assert_no_leaked_blocks(on.engine)


def test_outputs_with_caching_equal_outputs_without_under_preemption(tiny_llama_dir, expected):
    probe = make_llm(tiny_llama_dir, kv=1 << 22)
    small = make_llm(tiny_llama_dir, kv=10 * probe.engine.runner.bytes_per_block, max_model_len=128)
    outputs = small.generate(shared_prefix_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert small.engine.scheduler.num_preemptions_total > 0
    assert small.engine.kv_cache_manager.prefix_cache_hits > 0
    assert_no_leaked_blocks(small.engine)


def test_a_repeated_prompt_computes_only_its_last_block(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    prompt = {"prompt_token_ids": list(range(10, 10 + 40))}  # 2 full blocks + 8 tokens
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    second = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_requests_with_different_cache_salts_never_share_a_block(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    engine = llm.engine
    tokens = list(range(20, 70))
    engine.add_request("a", {"prompt_token_ids": tokens}, GREEDY, cache_salt="key-a")
    engine.step()  # a's prompt is computed and its blocks cached
    engine.add_request("b", {"prompt_token_ids": tokens}, GREEDY, cache_salt="key-b")
    engine.add_request("c", {"prompt_token_ids": tokens, "cache_salt": "key-a"}, GREEDY)
    engine.step()
    kv = engine.kv_cache_manager
    a, b, c = (set(kv.get_block_ids(r)) for r in "abc")
    assert not a & b, "two tenants share a KV block"
    assert len(a & c) == 3  # same salt: the 3 full blocks of the prompt are shared
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaked_blocks(engine)
