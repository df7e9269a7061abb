"""Greedy outputs equal Hugging Face transformers `generate`, token for token, in float32."""

import random

import pytest
import torch

from conftest import assert_no_leaked_blocks
from pagedserve import LLM, SamplingParams

PROMPT_LENS = [1, 3, 8, 15, 16, 17, 40, 77]
MAX_TOKENS = 20


def random_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                            pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_greedy_matches_transformers_alone_and_batched(fixture, request):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(fixture)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(hf_model.config.vocab_size)
    expected = [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]

    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]
    assert alone == expected
    assert batched == expected
    assert_no_leaked_blocks(llm.engine)


def test_default_model_greedy_matches_transformers_on_same_weights(default_model_path):
    """Three real prompts on SmolLM2-135M (GGUF, dequantized to float32) vs HF's Llama on the same tensors."""
    from transformers import AutoModelForCausalLM

    from pagedserve.loader.model_loader import open_checkpoint

    checkpoint = open_checkpoint(default_model_path)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(checkpoint.config, dtype=torch.float32)
    state = dict(checkpoint.iter_weights(torch.float32))
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf_model.load_state_dict(state, assign=True, strict=False)
    hf_model.model.rotary_emb.__init__(hf_model.config)  # buffers were on meta
    hf_model.eval()

    llm = LLM(default_model_path, dtype="float32", kv_cache_memory_bytes=1 << 27)
    tokenizer = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(texts, params, use_tqdm=False)
    for text, output in zip(texts, outputs):
        expected = hf_greedy(hf_model, tokenizer.encode(text), 16)
        assert output.outputs[0].token_ids == expected, text
        assert output.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert "Paris" in outputs[0].outputs[0].text
    assert_no_leaked_blocks(llm.engine)


def test_greedy_matches_transformers_with_each_isa_levels_kernels(isa, tiny_qwen2_dir):
    """float32 with the kernels forced to each level this CPU can run; at avx2 every linear and the LM head run on
    the packed float32 matmul (kernels/f32_gemm.py), biases included (Qwen2's q/k/v)."""
    from transformers import AutoModelForCausalLM

    from pagedserve.kernels import f32_gemm
    from pagedserve.layers.linear import Linear

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    prompts = random_prompts(hf_model.config.vocab_size)
    expected = [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
    llm = LLM(tiny_qwen2_dir, dtype="float32", kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=64)
    model = llm.engine.runner.model
    linears = [m for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"]
    packed = isa == "avx2" and f32_gemm.available()
    assert linears and all((m.packed_f32 is not None) == packed for m in linears)
    assert (model._packed_lm_head_f32 is not None) == packed
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_no_leaked_blocks(llm.engine)
