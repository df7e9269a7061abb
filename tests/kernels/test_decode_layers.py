"""decode_layers: a decode-only step's layers as one C call give exactly the Python path's outputs (small steps
at every level; any number of rows where every linear is held only packed, the AVX-512 BF16 level)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_c_decode_loop_matches_python_layers
from pagedserve import LLM, SamplingParams
from pagedserve.kernels import decode_layers, skinny_gemm


@pytest.fixture
def bf16_llm(tiny_llama_dir, isa):
    """A bf16 engine whose kernels (and packed weights) are those of the ISA level `isa`."""
    llm = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_memory_bytes=1 << 22, max_model_len=256)
    if llm.engine.runner.model._decode_layers is None:
        pytest.skip(f"no C path for every kernel at {isa} (bf16 small-batch matmul, fused ops, decode attention)")
    return llm


def test_c_layers_give_the_python_layers_tokens_and_logprobs_bit_for_bit(bf16_llm):
    prompts = ["The quick brown fox", "Paged attention", "Hello", "12345 678", "Bonjour"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    assert_c_decode_loop_matches_python_layers(bf16_llm, prompts, params)


def test_c_layers_run_only_for_small_decode_only_steps(bf16_llm, monkeypatch):
    model = bf16_llm.engine.runner.model
    calls = []
    original = decode_layers.DecodeLayers.forward
    monkeypatch.setattr(decode_layers.DecodeLayers, "forward",
                        lambda self, hidden, *a: calls.append(hidden.shape[0]) or original(self, hidden, *a))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    bf16_llm.generate(["one prompt of a few tokens"] * 3, params, use_tqdm=False)
    assert calls and set(calls) == {3}  # the prefill step took the Python path; each decode step the C one
    loop = model._decode_layers
    assert loop.runs(32, _decode_only_meta(32))
    # past MAX_ROWS only where the Python layers also compute every batch with the packed kernel
    assert loop.runs(33, _decode_only_meta(33)) == loop.runs(256, _decode_only_meta(256)) == skinny_gemm.takes_every_batch()


def test_c_layers_take_decode_steps_of_any_size_bit_for_bit_where_every_linear_is_packed_only(bf16_llm):
    if not skinny_gemm.takes_every_batch():
        pytest.skip("at this level the linears compute batches over MAX_ROWS with torch: the C loop keeps to small steps")
    prompts = [f"prompt number {i} " * (1 + i % 4) for i in range(40)]  # 40 sequences decode together
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    model = bf16_llm.engine.runner.model
    rows = []
    original = model._decode_layers.forward
    model._decode_layers.forward = lambda hidden, *a: rows.append(hidden.shape[0]) or original(hidden, *a)
    try:
        assert_c_decode_loop_matches_python_layers(bf16_llm, prompts, params)
    finally:
        del model._decode_layers.forward
    assert max(rows) == 40


def _decode_only_meta(rows: int):
    from pagedserve.attention.metadata import AttentionMetadata, DecodeBatch

    decode = DecodeBatch(torch.zeros(rows, 1, dtype=torch.long), torch.ones(rows, dtype=torch.long), 1, 16)
    return AttentionMetadata(torch.zeros(rows, dtype=torch.long), 1, 16, decode)
