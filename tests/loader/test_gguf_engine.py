"""The whole engine on a GGUF file equals the engine on the same weights from safetensors."""

import random

import pytest
import torch

from conftest import assert_no_leaked_blocks
from pagedserve import LLM, SamplingParams
from pagedserve.loader.gguf_writer import write_gguf


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True)


def prompts():
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, 390) for _ in range(n)]} for n in (3, 17, 40, 64)]


def gguf_engine(tiny_llama_dir, tmp_path, quant):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    path = tmp_path / f"tiny-{quant}.gguf"
    write_gguf(hf_model, path, quant=quant)
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True)


def test_gguf_f32_gives_exactly_the_safetensors_outputs_and_logprobs(tiny_llama_dir, tmp_path, reference):
    llm = gguf_engine(tiny_llama_dir, tmp_path, "F32")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    ours = llm.generate(prompts(), params, use_tqdm=False)
    ref = reference.generate(prompts(), params, use_tqdm=False)
    for a, b in zip(ours, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert_no_leaked_blocks(llm.engine)


def test_gguf_q8_0_logprobs_are_within_quantization_error(tiny_llama_dir, tmp_path, reference):
    llm = gguf_engine(tiny_llama_dir, tmp_path, "Q8_0")
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    ours = llm.generate(prompts(), params, use_tqdm=False)
    ref = reference.generate(prompts(), params, use_tqdm=False)
    worst = 0.0
    for a, b in zip(ours, ref):
        ref_top = b.outputs[0].logprobs[0]
        token = b.outputs[0].token_ids[0]
        ours_top = a.outputs[0].logprobs[0]
        assert a.outputs[0].token_ids[0] == token
        worst = max(worst, abs(ours_top[token].logprob - ref_top[token].logprob))
    # Q8_0 keeps ~0.4% relative error per weight; through 2 layers the logprob of the top token moves by
    # a few hundredths at most, while a wrong weight layout moves it by whole units.
    assert 0 < worst < 0.05
