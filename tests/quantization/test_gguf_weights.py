"""--quantization gguf: a GGUF file's Q8_0 / Q4_0 / Q4_1 linear weights stay quantized, hold exactly the values
the float loader would dequantize them to, and the engine computing from them gives the float engine's
results within the kernel's rounding; what cannot be kept quantized is refused or dequantized, by name."""

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

KEPT = ["Q8_0", "Q4_0", "Q4_1"]


@pytest.fixture(scope="module")
def gguf_files(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("gguf-quant")
    files = {}
    for quant in KEPT:
        files[quant] = str(folder / f"tiny-{quant}.gguf")
        write_gguf(hf_model, files[quant], quant=quant)
    return files


@pytest.mark.parametrize("quant", KEPT)
def test_kept_weights_hold_exactly_the_float_loaders_values(gguf_files, quant):
    checkpoint = GGUFCheckpoint(gguf_files[quant])
    dense = dict(checkpoint.iter_weights(torch.float32))
    kept = dict(checkpoint.iter_weights(torch.float32, keep_quantized=True))
    linear = [name for name, t in kept.items() if isinstance(t, QuantizedTensor)]
    assert len(linear) == 2 * 7  # q, k, v, o, gate, up, down of both layers; embeddings and norms stay float
    for name in linear:
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
    kept = llm.generate(prompts(), params, use_tqdm=False)
    # tiles: the same float32 products summed in another order; VNNI: activations rounded to int8 per 32
    tolerance = 0.05 if quant_gemm.uses_vnni() else 1e-3
    for a, b in zip(kept, dense):
        ours, theirs = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        token = b.outputs[0].token_ids[0]
        assert abs(ours[token].logprob - theirs[token].logprob) < tolerance
        first, second = sorted((lp.logprob for lp in theirs.values()), reverse=True)[:2]
        if first - second > 2 * tolerance:  # the random model has near-ties, which any rounding may flip
            assert a.outputs[0].token_ids[0] == token
    if not quant_gemm.uses_vnni():
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


def test_a_fused_linear_of_mixed_types_is_dequantized_not_refused(gguf_files, monkeypatch):
    """Q4_K_M-style files mix types inside q/k/v: such a fused linear falls back to its float weight."""
    from pagedserve.quantization import gguf_weights

    original = gguf_weights.from_gguf

    def v_as_kind_8(name, raw, qtype, shape):
        tensor = original(name, raw, qtype, shape)
        if "attn_v" in name:  # pretend v came as Q8_0: its values are kept, its kind differs
            w = tensor.dequantize()
            scale = w.view(shape[0], -1, 32).abs().amax(-1) / 127
            codes = torch.round(w.view(shape[0], -1, 32) / scale.clamp(min=1e-12).unsqueeze(-1))
            tensor = QuantizedTensor(name, tensor.qtype, codes.to(torch.int8).view(shape).view(torch.uint8),
                                                      scale, torch.zeros_like(scale), 8)
        return tensor

    monkeypatch.setattr(gguf_weights, "from_gguf", v_as_kind_8)
    llm = LLM(gguf_files["Q4_0"], quantization="gguf", dtype="float32", kv_cache_memory_bytes=1 << 22,
              skip_tokenizer_init=True)
    layer = llm.engine.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.quantized is None and layer.self_attn.qkv_proj.weight.numel() > 0
    assert layer.self_attn.o_proj.quantized is not None
    assert llm.generate(prompts()[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_c_decode_loop_on_kept_weights_gives_the_python_layers_results_bit_for_bit(gguf_files, kv_cache_dtype, isa):
    llm = LLM(gguf_files["Q4_1"], quantization="gguf", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
              kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True)
    model = llm.engine.runner.model
    if model._decode_layers is None:
        pytest.skip(f"no C decode loop at {isa} (it needs the bf16 small-batch matmul for the LM head)")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    assert_c_decode_loop_matches_python_layers(llm, prompts(), params)


def test_float16_activations_are_refused_before_loading(gguf_files):
    with pytest.raises(ValueError, match="takes float32 or bfloat16 activations, not torch.float16"):
        LLM(gguf_files["Q8_0"], quantization="gguf", dtype="float16", kv_cache_memory_bytes=1 << 22)
