"""AWQ and GPTQ checkpoints kept quantized against their float weights, on the default model: checkpoint and
resident memory, load time, W1 offline output tok/s and concurrency-16 TPOT, side by side in one run.

The default model is exported as a Hugging Face folder (benchmarks/export_hf.py: bf16 weights, the float case)
and its linears quantized here to 4 bits by round-to-nearest per output and group (asymmetric: a float16 scale
and a zero point; no calibration, which changes the values but not the layout or the cost), then written in the
checkpoint layouts the loader reads: AWQ GEMM, GPTQ (checkpoint_format gptq: zero points stored minus one) and
GPTQ with desc_act (act-order: each linear's inputs in a random order shared by the linears that read the same
input, as GPTQ's order from that input's Hessian is). The default model's linears take 576 or 1536 inputs: 576
is no multiple of 128, so the groups are --group-size 64 (the kernel keeps one scale and zero point per 64).
"Linears MiB" counts the checkpoint's qweight, qzeros, scales (and g_idx) and, resident, the packed weights
(and act-order's input order); the embeddings stay bf16 in both.

    python benchmarks/hf_quantized_weights.py [--repeats 2] [--group-size 64] [--dtype auto]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from export_hf import export  # noqa: E402
from gguf_weights import arguments, compare  # noqa: E402

from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.loader.model_loader import default_model_path  # noqa: E402

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTIZED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def round_to_nearest(w: torch.Tensor, order: torch.Tensor, group: int):
    """w [out, in] -> codes [in, out] and zeros [groups, out] (ints 0..15), scales [groups, out] float16, where
    group j holds inputs order[j * group: (j + 1) * group]."""
    out, inputs = w.shape
    blocks = w[:, order].view(out, inputs // group, group)
    lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-6).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    q = torch.clamp(torch.round(blocks / scales.float().unsqueeze(-1)) + zeros.unsqueeze(-1), 0, 15)
    codes = torch.empty(out, inputs, dtype=torch.int32)
    codes[:, order] = q.view(out, inputs).to(torch.int32)
    return codes.T.contiguous(), zeros.T.to(torch.int32).contiguous(), scales.T.contiguous()


def pack_nibbles(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """Nibbles packed 8 to an int32 along `dim` (0: GPTQ's input rows; 1: columns, nibble i = 8c + order[i])."""
    v = values.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)[..., list(order)].to(torch.int64) & 15
    words = sum(v[..., i] << (4 * i) for i in range(8))
    return (words - ((words >> 31) & 1) * (1 << 32)).to(torch.int32).movedim(-1, dim).contiguous()


def quantize_folder(source: str, target: str, method: str, group: int, desc_act: bool, seed: int = 0) -> int:
    """The float folder `source` with its linears written as `method` into `target`; the bytes of the
    quantized tensors."""
    os.makedirs(target, exist_ok=True)
    for name in os.listdir(source):
        if name != "model.safetensors":
            Path(target, name).write_bytes(Path(source, name).read_bytes())
    g, orders, tensors = torch.Generator().manual_seed(seed), {}, {}
    for name, w in load_file(f"{source}/model.safetensors").items():
        if not any(f".{linear}." in name for linear in LINEARS):
            tensors[name] = w
            continue
        prefix, inputs = name.rpartition(".")[0], w.shape[1]
        shared = prefix.rsplit(".", 1)[0] + ("/in" if name.split(".")[-2] in ("q_proj", "k_proj", "v_proj",
                                                                             "gate_proj", "up_proj") else name)
        order = orders.setdefault(shared, torch.randperm(inputs, generator=g) if desc_act else torch.arange(inputs))
        codes, zeros, scales = round_to_nearest(w.float(), order, group)
        if method == "awq":
            tensors.update({f"{prefix}.qweight": pack_nibbles(codes, 1, AWQ_ORDER),
                            f"{prefix}.qzeros": pack_nibbles(zeros, 1, AWQ_ORDER), f"{prefix}.scales": scales})
        else:
            group_of = torch.empty(inputs, dtype=torch.int32)
            group_of[order] = (torch.arange(inputs) // group).to(torch.int32)
            tensors.update({f"{prefix}.qweight": pack_nibbles(codes, 0), f"{prefix}.qzeros": pack_nibbles(zeros - 1, 1),
                            f"{prefix}.scales": scales, f"{prefix}.g_idx": group_of})
    save_file(tensors, f"{target}/model.safetensors", metadata={"format": "pt"})
    config = json.loads(Path(target, "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
        if method == "awq" else {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
                                 "sym": False, "checkpoint_format": "gptq"})
    Path(target, "config.json").write_text(json.dumps(config))
    return sum(t.numel() * t.element_size() for n, t in tensors.items() if n.rsplit(".", 1)[-1] in QUANTIZED_SUFFIXES)


def resident_linears(path: str) -> int:
    engine = LLMEngine.from_kwargs(model=path, max_model_len=64, kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True)
    modules = [m for m in engine.runner.model.modules() if getattr(m, "quantized", None) is not None]
    return sum(m.quantized.nbytes + (0 if m.input_order is None else m.input_order.numel() * 4) for m in modules)


def main() -> None:
    args = arguments(__doc__.split("\n")[0], group_size=dict(type=int, default=64))
    folder = tempfile.mkdtemp()
    float_dir = os.path.join(folder, "float")
    export(default_model_path(), float_dir, torch.bfloat16)
    cases = [("float weights (bf16 folder)", float_dir, None, os.path.getsize(f"{float_dir}/model.safetensors"))]
    linears = []
    for method, desc_act in (("awq", False), ("gptq", False), ("gptq", True)):
        name = f"{method.upper()}{' desc_act' if desc_act else ''}, group {args.group_size}"
        target = os.path.join(folder, name.replace(" ", "-").replace(",", ""))
        file_linears = quantize_folder(float_dir, target, method, args.group_size, desc_act)
        cases.append((name, target, None, os.path.getsize(f"{target}/model.safetensors")))
        linears.append((name, file_linears, resident_linears(target)))
    print("| checkpoint | linears in the checkpoint MiB | linears resident MiB | ratio |\n|---|---|---|---|")
    for name, file_bytes, resident in linears:
        print(f"| {name} | {file_bytes / 2**20:.2f} | {resident / 2**20:.2f} | {resident / file_bytes:.3f}x |")
    print()
    compare(cases, args)


if __name__ == "__main__":
    main()
