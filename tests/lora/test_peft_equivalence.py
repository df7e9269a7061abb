"""Each adapter gives peft's PeftModel's greedy tokens and logprobs on the same weights (float32), and not
the base model's: an adapter that was silently skipped would fail here."""

from __future__ import annotations

import pytest

from conftest import assert_no_leaked_blocks
from peft_adapters import ALL_MODULES, GREEDY_MAX_TOKENS, make_adapter, peft_reference, random_prompt
from pagedserve import LLM, LoRARequest, SamplingParams

PROMPTS = [random_prompt(seed, length) for seed, length in ((0, 5), (1, 17), (2, 40))]
PARAMS = SamplingParams(temperature=0, max_tokens=GREEDY_MAX_TOKENS, ignore_eos=True, logprobs=5)

# name -> (make_adapter keyword arguments)
KINDS = {
    "q_v_only": dict(modules=("q_proj", "v_proj"), rank=4),
    "all_modules": dict(modules=ALL_MODULES, rank=8),
    "rslora": dict(modules=ALL_MODULES, rank=16, alpha=6, use_rslora=True),
    "rank_2_mlp": dict(modules=("gate_proj", "up_proj", "down_proj"), rank=2),
}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_adapters")
    return {name: make_adapter(tiny_llama_dir, str(root / name), seed, **kw)
            for seed, (name, kw) in enumerate(KINDS.items(), start=10)}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 23, max_model_len=256, enable_lora=True,
               max_loras=4, max_lora_rank=16)


def _tokens_and_top(output):
    completion = output.outputs[0]
    return completion.token_ids, [_top_entries(step) for step in completion.logprobs]


def _top_entries(step: dict, top: int = 5) -> list[tuple[int, float]]:
    """The top (token, logprob) pairs of one position, best first."""
    ranked = sorted((lp.rank, token, lp.logprob) for token, lp in step.items() if 1 <= lp.rank <= top)
    return [(token, logprob) for _, token, logprob in ranked]


def assert_matches_peft(output, expected_tokens, expected_top) -> None:
    tokens, top = _tokens_and_top(output)
    assert tokens == expected_tokens
    for got, want in zip(top, expected_top):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=2e-4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_adapter_gives_peft_tokens_and_logprobs_and_not_the_base_models(kind, llm, adapter_dirs, tiny_llama_dir):
    lora = LoRARequest(kind, list(KINDS).index(kind) + 1, adapter_dirs[kind])
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False, lora_request=lora)
    base = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    for prompt, output, base_output in zip(PROMPTS, outputs, base):
        expected_tokens, expected_top = peft_reference(tiny_llama_dir, adapter_dirs[kind], prompt)
        assert_matches_peft(output, expected_tokens, expected_top)
        assert output.outputs[0].token_ids != base_output.outputs[0].token_ids
    assert_no_leaked_blocks(llm.engine)


def test_adapters_of_mixed_ranks_in_one_batch_each_give_peft_output(llm, adapter_dirs, tiny_llama_dir):
    names = list(KINDS)  # ranks 4, 8, 16, 2 in the 4 slots at once, and the base model
    loras = [LoRARequest(name, i + 1, adapter_dirs[name]) for i, name in enumerate(names)] + [None]
    prompt = PROMPTS[1]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * len(loras), PARAMS, use_tqdm=False, lora_request=loras)
    for lora, output in zip(loras, outputs):
        expected = peft_reference(tiny_llama_dir, lora and lora.lora_path, prompt)
        assert_matches_peft(output, *expected)
    assert_no_leaked_blocks(llm.engine)
