"""--quantization gguf: a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K linear weights (and Q4_K_M's mix of
them inside one fused linear) stay quantized, hold exactly the values the float loader would dequantize them
to, and the engine computing from them gives the float engine's results within the kernel's rounding; what
cannot be kept quantized is refused or dequantized, by name."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import assert_c_decode_loop_matches_python_layers, assert_no_leaked_blocks
from pagedserve import LLM, SamplingParams
from pagedserve.kernels import quant_gemm
from pagedserve.loader.gguf import GGUFCheckpoint
from pagedserve.loader.gguf_writer import write_gguf
from pagedserve.quantization.quantized_tensor import QuantizedTensor

KEPT = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q4_K_M"]
K_QUANTS = {"Q4_K": ("Q4_K", None), "Q6_K": ("Q6_K", None),
            "Q4_K_M": ("Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K"})}
"""(quant, quant_by_kind): K-quants need 256 inputs a row, so they get a wider model; Q4_K_M-like: Q4_K with a
Q6_K v and down, as llama.cpp's Q4_K_M keeps them (in half its layers)."""


def wide_model(tiny_llama_dir) -> torch.nn.Module:
    """The tiny model's architecture and vocabulary, 256 wide (random weights, seeded)."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 512, 64
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


@pytest.fixture(scope="module")
def gguf_files(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    wide = wide_model(tiny_llama_dir)
    folder = tmp_path_factory.mktemp("gguf-quant")
    files = {}
    for quant in KEPT:
        files[quant] = str(folder / f"tiny-{quant}.gguf")
        if quant in K_QUANTS:
            base, by_kind = K_QUANTS[quant]
            write_gguf(wide, files[quant], quant=base, quant_by_kind=by_kind)
        else:
            write_gguf(hf_model, files[quant], quant=quant)
    return files


@pytest.mark.parametrize("quant", KEPT)
def test_kept_weights_hold_exactly_the_float_loaders_values(gguf_files, quant):
    checkpoint = GGUFCheckpoint(gguf_files[quant])
    dense = dict(checkpoint.iter_weights(torch.float32))
    kept = dict(checkpoint.iter_weights(torch.float32, keep_quantized=True))
    quantized = [name for name, t in kept.items() if isinstance(t, QuantizedTensor)]
    # q, k, v, o, gate, up, down of both layers, the token embeddings and the LM head; the norms stay float
    assert len(quantized) == 2 * 7 + 2 and {"model.embed_tokens.weight", "lm_head.weight"} <= set(quantized)
    for name in quantized:
        assert torch.equal(kept[name].dequantize(), dense[name]), name  # q/k rows un-permuted as well


def prompts():
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, 390) for _ in range(n)]} for n in (3, 17, 40, 64)]


@pytest.mark.parametrize("quant", KEPT)
def test_engine_on_kept_weights_gives_the_float_engines_results(gguf_files, quant, isa):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    common = dict(dtype="float32", kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True, device="cpu")
    dense = LLM(gguf_files[quant], **common).generate(prompts(), params, use_tqdm=False)
    llm = LLM(gguf_files[quant], quantization="gguf", **common)
    model = llm.engine.runner.model
    assert all(layer.mlp.down_proj.quantized is not None and layer.mlp.down_proj.weight.numel() == 0
               for layer in model.model.layers)
    assert all(table.quantized is not None and table.weight.numel() == 0
               for table in (model.model.embed_tokens, model.lm_head))
    kept = llm.generate(prompts(), params, use_tqdm=False)
    # tiles: the same float32 products summed in another order; VNNI: activations rounded to int8 per 32
    # (the K-quant files' model is 4x wider, so int8 activations add up to larger logit errors)
    tolerance = (0.2 if quant in K_QUANTS else 0.05) if quant_gemm.quantizes_activations() else 1e-3  # measured: 0.12, 0.023
    for a, b in zip(kept, dense):
        ours, theirs = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        token = b.outputs[0].token_ids[0]
        assert abs(ours[token].logprob - theirs[token].logprob) < tolerance
        first, second = sorted((lp.logprob for lp in theirs.values()), reverse=True)[:2]
        if first - second > 2 * tolerance:  # the random model has near-ties, which any rounding may flip
            assert a.outputs[0].token_ids[0] == token
    if not quant_gemm.quantizes_activations():
        assert [o.outputs[0].token_ids for o in kept] == [o.outputs[0].token_ids for o in dense]
    assert_no_leaked_blocks(llm.engine)


def test_quantization_gguf_on_a_folder_is_an_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="needs a GGUF file"):
        LLM(tiny_llama_dir, quantization="gguf", kv_cache_memory_bytes=1 << 22)


def test_an_unknown_quantization_method_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of None, gguf"):
        LLM(quantization="awq4")


def test_q4_k_groups_hold_exactly_the_float_loaders_values():
    """Random Q4_K super-blocks (any bytes are a valid block once d and dmin are finite): their 32-value groups
    dequantize to what loader/gguf_quants.py makes of the same bytes."""
    import numpy as np
    from gguf import GGMLQuantizationType as QType

    from pagedserve.loader.gguf_quants import dequantize
    from pagedserve.quantization.gguf_weights import from_gguf

    rng = np.random.default_rng(0)
    n, k = 16, 512
    blocks = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    blocks[:, 0:4] = np.frombuffer(rng.uniform(0.001, 0.05, size=(len(blocks), 2)).astype(np.float16).tobytes(),
                                   dtype=np.uint8).reshape(-1, 4)
    kept = from_gguf("w", blocks, QType.Q4_K, (n, k))
    assert kept.kind == 4 and kept.scales.shape == (n, k // 32)
    assert torch.equal(kept.dequantize(), dequantize(blocks, QType.Q4_K, (n, k)))
    packed = quant_gemm.QuantizedWeight.pack(kept.codes, kept.scales, kept.offsets, 4, "Q4_K")
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    exact = x.double() @ kept.dequantize().double().T
    assert ((quant_gemm.linear(x, packed).double() - exact).abs() <= 0.02 * exact.abs().max()).all()


def test_q6_k_sub_blocks_hold_exactly_the_float_loaders_values():
    """Random Q6_K super-blocks (any bytes are a valid block once d is finite): kind 6's codes and 16-value
    scales dequantize to what loader/gguf_quants.py makes of the same bytes, and the kernel computes with them."""
    import numpy as np
    from gguf import GGMLQuantizationType as QType

    from pagedserve.loader.gguf_quants import dequantize
    from pagedserve.quantization.gguf_weights import from_gguf

    rng = np.random.default_rng(1)
    n, k = 32, 512
    blocks = rng.integers(0, 256, size=(n * k // 256, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.frombuffer(rng.uniform(1e-4, 5e-3, size=len(blocks)).astype(np.float16).tobytes(),
                                       dtype=np.uint8).reshape(-1, 2)
    kept = from_gguf("w", blocks, QType.Q6_K, (n, k))
    assert kept.kind == 6 and kept.scales.shape == (n, k // 16) and int(kept.codes.max()) <= 63
    assert torch.equal(kept.dequantize(), dequantize(blocks, QType.Q6_K, (n, k)))
    packed = quant_gemm.QuantizedWeight.pack(kept.codes, kept.scales, kept.offsets, 6, "Q6_K")
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
    exact = x.double() @ kept.dequantize().double().T
    assert ((quant_gemm.linear(x, packed).double() - exact).abs() <= 0.02 * exact.abs().max()).all()


def test_a_q4_k_m_files_fused_linears_of_mixed_types_stay_quantized(gguf_files):
    """Q4_K_M mixes types inside q/k/v (Q4_K q and k, Q6_K v): the fused linear is packed as one weight of
    mixed column blocks, not dequantized; down is kind 6, gate/up kind 4."""
    llm = LLM(gguf_files["Q4_K_M"], quantization="gguf", dtype="float32", kv_cache_memory_bytes=1 << 22,
              skip_tokenizer_init=True)
    for layer in llm.engine.runner.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv_proj.quantized.kind == quant_gemm.MIXED and attn.qkv_proj.weight.numel() == 0
        assert attn.qkv_proj.quantized.source_type == "Q4_K+Q6_K"
        assert (mlp.down_proj.quantized.kind, mlp.gate_up_proj.quantized.kind, attn.o_proj.quantized.kind) == (6, 4, 4)
    assert_no_leaked_blocks(llm.engine)


def test_a_linear_only_partly_quantized_is_dequantized_not_refused(gguf_files, monkeypatch):
    """A fused linear with a shard left float (a type not kept quantized) falls back to its float weight."""
    from pagedserve.loader import gguf as gguf_loader

    from gguf import GGMLQuantizationType as QType

    monkeypatch.setattr(gguf_loader.gguf_weights, "KEPT_TYPES", gguf_loader.gguf_weights.KEPT_TYPES - {QType.Q6_K})
    llm = LLM(gguf_files["Q4_K_M"], quantization="gguf", dtype="float32", kv_cache_memory_bytes=1 << 22,
              skip_tokenizer_init=True)
    layer = llm.engine.runner.model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    # its float weight: plain, or (float32 on an AVX2-only CPU) packed for kernels/f32_gemm.py as its only copy
    assert qkv.quantized is None and (qkv.weight.numel() > 0 or qkv.packed_f32 is not None)
    assert layer.self_attn.o_proj.quantized is not None and layer.mlp.down_proj.quantized is None
    assert llm.generate(prompts()[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("quant,kv_cache_dtype", [("Q4_1", "auto"), ("Q4_1", "int8"), ("Q4_K_M", "auto")])
def test_c_decode_loop_on_kept_weights_gives_the_python_layers_results_bit_for_bit(gguf_files, quant, kv_cache_dtype,
                                                                                  isa):
    llm = LLM(gguf_files[quant], quantization="gguf", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
              kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True)
    model = llm.engine.runner.model
    if model._decode_layers is None:
        pytest.skip(f"no C decode loop at {isa} (it needs the bf16 small-batch matmul for the LM head)")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    assert_c_decode_loop_matches_python_layers(llm, prompts(), params)


def test_float16_activations_are_refused_before_loading(gguf_files):
    with pytest.raises(ValueError, match="takes float32 or bfloat16 activations, not torch.float16"):
        LLM(gguf_files["Q8_0"], quantization="gguf", dtype="float16", kv_cache_memory_bytes=1 << 22)


@pytest.mark.parametrize("quant", KEPT)
def test_kept_weights_take_about_what_the_file_holds(gguf_files, quant):
    """Resident weights within 10% of the file: float16 scales for Q8_0 / Q4_0 / Q4_1, Q4_K's and Q6_K's scales as
    the file holds them, and the embeddings and LM head kept quantized too (no float copy of anything)."""
    from gguf import GGUFReader

    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(gguf_files[quant]).tensors)
    llm = LLM(gguf_files[quant], quantization="gguf", dtype="bfloat16", kv_cache_memory_bytes=1 << 22,
              skip_tokenizer_init=True, device="cpu")
    model = llm.engine.runner.model
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    kept = sum(m.quantized.nbytes for m in model.modules() if getattr(m, "quantized", None) is not None)
    packed = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None] + [model._packed_lm_head]
    assert not any(p is not None for p in packed)  # every linear kept quantized: no bf16 copy packed
    assert parameters + kept <= 1.1 * file_bytes, (parameters, kept, file_bytes)
