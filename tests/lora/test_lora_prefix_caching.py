"""Prefix caching with adapters: KV computed under one adapter is never reused under another, under the base
model, or under a reload of the same adapter name with new weights."""

from __future__ import annotations

import pytest

from conftest import assert_no_leaked_blocks
from peft_adapters import ALL_MODULES, make_adapter, random_prompt
from pagedserve import LLM, LoRARequest, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": random_prompt(7, 3 * 16 + 5)}  # 3 full blocks and a partial one
FULL_BLOCK_TOKENS = 48


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cache_adapters")
    return {name: make_adapter(tiny_llama_dir, str(root / name), seed, modules=ALL_MODULES)
            for name, seed in (("a", 1), ("b", 2), ("a_retrained", 3))}


@pytest.fixture
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=256, enable_lora=True,
               max_loras=2)


def run(llm, lora=None):
    [out] = llm.generate(PROMPT, PARAMS, use_tqdm=False, lora_request=lora)
    return out


def test_one_prompt_under_two_adapters_and_the_base_model_shares_no_block(llm, adapter_dirs):
    a, b = LoRARequest("a", 1, adapter_dirs["a"]), LoRARequest("b", 2, adapter_dirs["b"])
    firsts = [run(llm), run(llm, a), run(llm, b)]
    assert [o.num_cached_tokens for o in firsts] == [0, 0, 0]
    assert len({tuple(o.outputs[0].token_ids) for o in firsts}) == 3
    # Each one's own blocks are cached: a repeat under the same identity hits them, with the same output.
    for first, lora in zip(firsts, (None, a, b)):
        again = run(llm, lora)
        assert again.num_cached_tokens == FULL_BLOCK_TOKENS
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_leaked_blocks(llm.engine)


def test_a_reloaded_adapter_never_hits_the_old_weights_blocks(llm, adapter_dirs, tiny_llama_dir):
    old = run(llm, LoRARequest("a", 1, adapter_dirs["a"]))
    assert run(llm, LoRARequest("a", 1, adapter_dirs["a"])).num_cached_tokens == FULL_BLOCK_TOKENS
    assert llm.engine.remove_lora(1)
    retrained = LoRARequest("a", 2, adapter_dirs["a_retrained"])
    assert llm.engine.add_lora(retrained)
    new = run(llm, retrained)
    assert new.num_cached_tokens == 0
    fresh = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=256, enable_lora=True)
    assert new.outputs[0].token_ids == run(fresh, retrained).outputs[0].token_ids != old.outputs[0].token_ids
    assert_no_leaked_blocks(llm.engine)


def test_removing_and_adding_the_same_adapter_again_starts_a_new_cache(llm, adapter_dirs):
    a = LoRARequest("a", 1, adapter_dirs["a"])
    first = run(llm, a)
    assert llm.engine.remove_lora(1)
    again = run(llm, a)  # loaded again on admission: a new load, whose files may have changed
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_leaked_blocks(llm.engine)
