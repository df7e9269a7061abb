"""AWQ (GEMM) and GPTQ (4-bit, desc_act false and true) checkpoints, written here in their documented layouts
from a tiny model's float weights, load from config.json's quantization_config onto the quantized matmul: the
kept weights are exactly the checkpoint's dequantized values, the engine's outputs match an engine on those
values, and the float weights they were made from within the 4-bit quantization error. Unsupported variants
and malformed tensors are refused, by name."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_c_decode_loop_matches_python_layers, assert_no_leaked_blocks
from pagedserve import LLM, SamplingParams
from pagedserve.loader.safetensors import HFFolderCheckpoint
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing, written out here rather than imported
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_4bit(w: torch.Tensor, group_of: torch.Tensor):
    """Asymmetric 4-bit per (output, group): w [out, in] -> codes [in, out], zeros [groups, out] int,
    scales [groups, out] fp16, and the dequantized weight [out, in]."""
    out, inputs = w.shape
    groups = int(group_of.max()) + 1
    codes = torch.zeros(inputs, out, dtype=torch.int32)
    zeros = torch.zeros(groups, out, dtype=torch.int32)
    scales = torch.zeros(groups, out, dtype=torch.float16)
    for g in range(groups):
        cols = (group_of == g).nonzero().flatten()
        block = w[:, cols]
        lo, hi = block.min(1).values.clamp(max=0), block.max(1).values.clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-6).half()
        z = torch.round(-lo / s.float()).clamp(0, 15).to(torch.int32)
        q = torch.clamp(torch.round(block / s.float()[:, None]) + z[:, None], 0, 15).to(torch.int32)
        codes[cols] = q.T
        zeros[g], scales[g] = z, s
    dequantized = ((codes.T - zeros[group_of].T).float() * scales[group_of].T.float())
    return codes, zeros, scales, dequantized


def pack_columns(values: torch.Tensor, order) -> torch.Tensor:
    """[rows, out] nibbles -> [rows, out / 8] int32, nibble i = column 8c + order[i]."""
    rows, out = values.shape
    v = values.view(rows, out // 8, 8)[..., list(order)].to(torch.int64)
    words = sum((v[..., i] & 15) << (4 * i) for i in range(8))
    return (words - ((words >> 31) & 1) * (1 << 32)).to(torch.int32)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[in, out] nibbles -> [in / 8, out] int32, nibble j = input row 8r + j (GPTQ)."""
    inputs, out = values.shape
    v = values.view(inputs // 8, 8, out).to(torch.int64)
    words = sum((v[:, j] & 15) << (4 * j) for j in range(8))
    return (words - ((words >> 31) & 1) * (1 << 32)).to(torch.int32)


def _input_of(name: str) -> str:
    """Linears that read the same input (q/k/v; gate/up) share it: GPTQ's act-order, from that input's Hessian,
    orders their inputs alike."""
    for shared, members in (("attention-input", ("q_proj", "k_proj", "v_proj")), ("mlp-input", ("gate_proj", "up_proj"))):
        if any(f".{m}." in name for m in members):
            return name.split(".self_attn.")[0].split(".mlp.")[0] + shared
    return name


def write_checkpoint(source: str, target, method: str, desc_act: bool = False, group: int = 32,
                     seed: int = 0, shared_orders: bool = True) -> tuple[str, str]:
    """The tiny model quantized as `method` in groups of `group` inputs, and beside it a float checkpoint of the
    dequantized weights. shared_orders=False: act-order gives every linear an order of its own."""
    quantized_dir = target / f"{method}-{desc_act}-{group}-{shared_orders}"
    dequantized_dir = target / f"{method}-{desc_act}-{group}-{shared_orders}-float"
    for d in (quantized_dir, dequantized_dir):
        shutil.copytree(source, d)
    tensors = load_file(f"{source}/model.safetensors")
    quantized, dequantized = {}, {}
    g = torch.Generator().manual_seed(seed)
    orders = {}
    for name, w in tensors.items():
        prefix, _, _ = name.rpartition(".")
        if not any(f".{linear}." in name for linear in LINEARS):
            quantized[name] = dequantized[name] = w
            continue
        inputs = w.shape[1]
        key = _input_of(name) if shared_orders else name
        order = orders.setdefault(key, torch.randperm(inputs, generator=g) if desc_act else torch.arange(inputs))
        group_of = torch.empty(inputs, dtype=torch.int64)
        group_of[order] = torch.arange(inputs) // group  # act-order: the k-th input processed is in group k // 32
        codes, zeros, scales, w_hat = quantize_4bit(w.float(), group_of)
        dequantized[name] = w_hat.contiguous()
        if method == "awq":
            quantized.update({f"{prefix}.qweight": pack_columns(codes, AWQ_ORDER),
                              f"{prefix}.qzeros": pack_columns(zeros, AWQ_ORDER), f"{prefix}.scales": scales})
        else:
            quantized.update({f"{prefix}.qweight": pack_rows(codes), f"{prefix}.qzeros": pack_columns(zeros - 1, range(8)),
                              f"{prefix}.scales": scales, f"{prefix}.g_idx": group_of.to(torch.int32)})
    save_file(quantized, f"{quantized_dir}/model.safetensors")
    save_file(dequantized, f"{dequantized_dir}/model.safetensors")
    config = json.loads((quantized_dir / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
        if method == "awq" else {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
                                 "sym": False, "checkpoint_format": "gptq"})
    (quantized_dir / "config.json").write_text(json.dumps(config))
    return str(quantized_dir), str(dequantized_dir)


CASES = [("awq", False, 32), ("awq", False, 64), ("gptq", False, 32), ("gptq", True, 32), ("gptq", True, 64)]
"""(method, desc_act, group size): 64 is two kernel groups of 32 with one scale, as 128 is four."""


@pytest.fixture(scope="module")
def checkpoints(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf-quantized")
    return {case: write_checkpoint(tiny_llama_dir, folder, *case) for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-desc_act={c[1]}-group={c[2]}")
def test_kept_weights_are_exactly_the_checkpoints_dequantized_values(checkpoints, case):
    quantized_dir, dequantized_dir = checkpoints[case]
    kept = dict(HFFolderCheckpoint(quantized_dir).iter_weights(torch.float32, keep_quantized=True))
    reference = load_file(f"{dequantized_dir}/model.safetensors")
    linear = [n for n in kept if any(f".{lin}." in n for lin in LINEARS)]
    assert len(linear) == 2 * 7
    for name in linear:
        assert torch.equal(kept[name].dequantize(), reference[name]), name
        # act-order moves inputs between groups only where there is more than one group
        assert (kept[name].input_order is not None) == (case[1] and kept[name].shape[1] > case[2])


def prompts():
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, 390) for _ in range(n)]} for n in (3, 17, 40, 64)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-desc_act={c[1]}-group={c[2]}")
def test_engine_matches_the_dequantized_and_the_original_float_weights(checkpoints, tiny_llama_dir, case, isa):
    from pagedserve.kernels import quant_gemm

    quantized_dir, dequantized_dir = checkpoints[case]
    common = dict(dtype="float32", kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    llm = LLM(quantized_dir, **common)  # the method comes from quantization_config
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.quantized is not None
    ours = llm.generate(prompts(), params, use_tqdm=False)
    same_values = LLM(dequantized_dir, **common).generate(prompts(), params, use_tqdm=False)
    original = LLM(tiny_llama_dir, **common).generate(prompts(), params, use_tqdm=False)
    kernel_rounding = 0.05 if quant_gemm.quantizes_activations() else 1e-3
    for a, b, c in zip(ours, same_values, original):
        token = b.outputs[0].token_ids[0]
        assert abs(a.outputs[0].logprobs[0][token].logprob - b.outputs[0].logprobs[0][token].logprob) < kernel_rounding
        # 4-bit weights move this random model's top logprob by a few tenths at most (a layout error: units)
        top = c.outputs[0].token_ids[0]
        if top in a.outputs[0].logprobs[0]:
            assert abs(a.outputs[0].logprobs[0][top].logprob - c.outputs[0].logprobs[0][top].logprob) < 0.5
    assert_no_leaked_blocks(llm.engine)


def test_unsupported_variants_are_refused_with_the_reason(checkpoints, tmp_path):
    quantized_dir, _ = checkpoints[("awq", False, 32)]
    for change, message in [({"bits": 8}, "awq with bits=8 is not supported"),
                            ({"version": "gemv"}, "awq version='gemv'"),
                            ({"group_size": 48}, "group_size=48 is not supported"),
                            ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported")]:
        folder = tmp_path / f"bad-{len(message)}"
        shutil.copytree(quantized_dir, folder)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"].update(change)
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True)


def test_a_malformed_tensor_is_an_error_naming_it(checkpoints, tmp_path):
    quantized_dir, _ = checkpoints[("gptq", False, 32)]
    folder = tmp_path / "malformed"
    shutil.copytree(quantized_dir, folder)
    tensors = load_file(f"{folder}/model.safetensors")
    name = "model.layers.1.mlp.down_proj.scales"
    tensors[name] = tensors[name][:1]  # one group of scales where there are four
    save_file(tensors, f"{folder}/model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj"):
        LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True)


def test_asking_for_another_method_than_the_checkpoints_is_refused(checkpoints):
    quantized_dir, _ = checkpoints[("awq", False, 32)]
    with pytest.raises(ValueError, match="quantization='gptq' needs a checkpoint quantized with it"):
        LLM(quantized_dir, quantization="gptq", kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True)


def test_awq_nibbles_unpack_to_columns_in_autoawqs_order():
    """One word, 0x76543210: nibble i holds the value i, so column 8c + AWQ_ORDER[i] must come back as i."""
    from pagedserve.quantization.hf_quantized import _columns

    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert _columns(word, AWQ_ORDER).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]


def test_gptq_zero_points_of_zero_wrap_as_autogptq_reads_them(checkpoints):
    """A stored z - 1 of -1 is the nibble 15, read back (masked, + 1) as 16, as AutoGPTQ and vLLM read it."""
    from pagedserve.quantization.hf_quantized import QuantizationConfig, to_quantized_tensor

    config = QuantizationConfig.from_hf({"quant_method": "gptq", "bits": 4, "group_size": 32})
    tensors = {"qweight": torch.zeros(4, 16, dtype=torch.int32), "qzeros": torch.full((1, 2), -1, dtype=torch.int32),
               "scales": torch.ones(1, 16, dtype=torch.float16)}
    kept = to_quantized_tensor("w", tensors, config)
    assert torch.equal(kept.dequantize(), torch.full((16, 32), -16.0))


def test_all_zero_biases_of_bias_free_layers_are_skipped(checkpoints, tmp_path):
    quantized_dir, _ = checkpoints[("gptq", False, 32)]
    folder = tmp_path / "extra-bias"
    shutil.copytree(quantized_dir, folder)
    tensors = load_file(f"{folder}/model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64, dtype=torch.float16)
    save_file(tensors, f"{folder}/model.safetensors")
    common = dict(dtype="float32", kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True, device="cpu")
    LLM(str(folder), **common)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.ones(64, dtype=torch.float16)
    save_file(tensors, f"{folder}/model.safetensors")
    with pytest.raises(ValueError, match="q_proj.bias' has no matching parameter"):
        LLM(str(folder), **common)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-desc_act={c[1]}-group={c[2]}")
def test_resident_weights_are_within_10_percent_of_the_checkpoints_tensors(checkpoints, case):
    """Each linear keeps one float16 scale and zero point per group, as the checkpoint's scales and qzeros do,
    beside its 4-bit codes (and act-order's input order, as its g_idx)."""
    from pagedserve.kernels import quant_gemm

    quantized_dir, _ = checkpoints[case]
    llm = LLM(quantized_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True, device="cpu")
    tensors = load_file(f"{quantized_dir}/model.safetensors")
    file_bytes = sum(t.numel() * t.element_size() for name, t in tensors.items()
                     if name.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx"))
    modules = [m for m in llm.engine.runner.model.modules() if getattr(m, "quantized", None) is not None]
    assert len(modules) == 2 * 4  # fused qkv and gate_up, o_proj, down_proj per layer
    assert all(m.quantized.flags & quant_gemm.GROUP_SCALES for m in modules)
    resident = sum(m.quantized.nbytes + (0 if m.input_order is None else m.input_order.numel() * 4) for m in modules)
    assert resident <= 1.1 * file_bytes, (resident, file_bytes)


def test_scales_float16_cannot_hold_are_kept_per_32_in_float32():
    from pagedserve.quantization.hf_quantized import QuantizationConfig, to_quantized_tensor

    config = QuantizationConfig.from_hf({"quant_method": "awq", "bits": 4, "group_size": 64})
    scales = torch.full((1, 16), 1 / 3)  # float32, not a float16 value
    tensors = {"qweight": torch.full((64, 2), 0x11111111, dtype=torch.int32),
               "qzeros": torch.zeros(1, 2, dtype=torch.int32), "scales": scales}
    kept = to_quantized_tensor("w", tensors, config)
    assert kept.group_scales is None and torch.equal(kept.dequantize(), torch.full((16, 64), 1 / 3))
    tensors["scales"] = scales.half()
    assert to_quantized_tensor("w", tensors, config).group_scales.group_size == 64


def test_fused_shards_whose_act_orders_differ_are_dequantized_and_still_right(tiny_llama_dir, tmp_path):
    quantized_dir, dequantized_dir = write_checkpoint(tiny_llama_dir, tmp_path, "gptq", True, 32, shared_orders=False)
    common = dict(dtype="float32", kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True, device="cpu")
    llm = LLM(quantized_dir, **common)
    layer = llm.engine.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.quantized is None and layer.self_attn.o_proj.quantized is not None
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    ours = llm.generate(prompts(), params, use_tqdm=False)
    same_values = LLM(dequantized_dir, **common).generate(prompts(), params, use_tqdm=False)
    for a, b in zip(ours, same_values):
        token = b.outputs[0].token_ids[0]
        assert abs(a.outputs[0].logprobs[0][token].logprob - b.outputs[0].logprobs[0][token].logprob) < 0.05


def test_act_order_layers_run_in_the_one_call_c_decode_loop_with_the_python_layers_tokens(checkpoints):
    """Each act-order linear hands its input order to the kernel, which gathers x itself, in the C decode loop
    as on the Python path."""
    quantized_dir, _ = checkpoints[("gptq", True, 32)]
    llm = LLM(quantized_dir, dtype="bfloat16", kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True, device="cpu")
    model = llm.engine.runner.model
    if model._decode_layers is None:
        pytest.skip("no C decode loop here (it needs the bf16 small-batch kernel: not on the generic level)")
    assert model.model.layers[0].self_attn.qkv_proj.input_order is not None
    assert_c_decode_loop_matches_python_layers(llm, prompts(), SamplingParams(temperature=0, max_tokens=6, logprobs=1))


@pytest.mark.parametrize("tie", [False, True], ids=["lm_head", "tied-embeddings"])
def test_the_bf16_lm_head_of_a_quantized_model_is_held_once(tiny_llama_dir, tmp_path, tie):
    """With its linears kept quantized, the model holds its bf16 LM head only packed for the small-batch kernel
    (tied: the embeddings read their rows from it), so the whole model stays within 10% of its checkpoint; above
    32 rows the LM head runs on that kernel too, so a request's tokens do not depend on the batch."""
    from conftest import build_tiny_model

    source = build_tiny_model(str(tmp_path / "tied"), "llama", tie=True) if tie else tiny_llama_dir
    quantized_dir, _ = write_checkpoint(source, tmp_path, "awq", group=32)
    llm = LLM(quantized_dir, dtype="bfloat16", kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True, device="cpu")
    model = llm.engine.runner.model
    if model._packed_lm_head is None:
        pytest.skip("no bf16 small-batch kernel here (generic level): the LM head stays a torch weight")
    assert model.lm_head_weight.numel() == 0 and (model.model.embed_tokens.packed is not None) == tie
    resident = sum(p.numel() * p.element_size() for p in model.parameters()) + model._packed_lm_head.data.nbytes
    resident += sum(m.quantized.nbytes for m in model.modules() if getattr(m, "quantized", None) is not None)
    tensors = load_file(f"{quantized_dir}/model.safetensors")
    assert resident <= 1.1 * sum(t.numel() * t.element_size() for t in tensors.values())
    rng = random.Random(1)
    many = [{"prompt_token_ids": [rng.randrange(3, 390) for _ in range(5)]} for _ in range(40)]
    params = SamplingParams(temperature=0, max_tokens=4)
    together = llm.generate(many, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in many[:3]]
    assert [o.outputs[0].token_ids for o in together[:3]] == [o.outputs[0].token_ids for o in alone]
    assert_no_leaked_blocks(llm.engine)
