"""Weights kept quantized (--quantization gguf) against float weights, on the default model: resident weight
memory, load time, W1 offline output tok/s and concurrency-16 TPOT, side by side in one run.

Cases: the float weights (the default model's file dequantized to --dtype, as without --quantization), the
default model's own file (Q4_1) kept quantized, and the same weights requantized to Q8_0, Q4_0, and Q4_0 with a
Q6_K down_proj (llama.cpp's Q4_K_M keeps down in Q6_K; the model's other linears take 576 inputs, which K-quants'
rows of 256 do not divide, so llama.cpp falls back to a 32-group type for them too) (written here
with pagedserve's GGUF writer from the float weights, token embeddings in the same type; kept quantized, the tied
token embeddings / LM head are one quantized table too). Prompts are random token ids, so the
requantized files need no tokenizer of their own. The cases run interleaved --repeats times; medians.

    python benchmarks/gguf_weights.py [--repeats 2] [--dtype auto] [--w1-requests 256] [--kernel-flags='...']
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.benchmarks.cpu_kind import cpu_kind
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.kernels import quant_gemm
from pagedserve.kernels.build import load_library
from pagedserve.loader.gguf_writer import write_gguf
from pagedserve.loader.model_loader import default_model_path, open_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from lora_throughput import run_case, warm_up  # noqa: E402


def requantized(quant: str, folder: str, by_kind: dict | None = None) -> str:
    """The default model's weights (dequantized in float32) written as a GGUF file of type `quant` (`by_kind`:
    types for some tensor kinds instead)."""
    from transformers import LlamaForCausalLM

    checkpoint = open_checkpoint(None)
    model = LlamaForCausalLM(checkpoint.config)
    model.load_state_dict(dict(checkpoint.iter_weights(torch.float32)), strict=False)
    model.tie_weights()
    path = os.path.join(folder, f"smollm2-{quant}{'-' + '-'.join(by_kind.values()) if by_kind else ''}.gguf")
    write_gguf(model, path, quant=quant, tokenizer=False, quant_by_kind=by_kind)
    return path


def weight_bytes(engine: LLMEngine) -> int:
    """Parameters, kept-quantized weights (and GPTQ act-order's input orders) and the copies packed for the
    small-batch kernels (bf16, or float32 on AVX2-only CPUs; LM head included), each counted once."""
    model = engine.runner.model
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    kept = sum(m.quantized.nbytes + (0 if getattr(m, "input_order", None) is None else m.input_order.nbytes)
               for m in model.modules() if getattr(m, "quantized", None) is not None)
    packed = [getattr(m, name) for m in model.modules() for name in ("packed", "packed_f32")
              if getattr(m, name, None) is not None]
    packed += [getattr(model, "_packed_lm_head", None), getattr(model, "_packed_lm_head_f32", None)]
    unique = {id(p): p for p in packed if p is not None}  # a tied table held packed is the LM head's copy
    return dense + kept + sum(p.data.numel() * p.data.element_size() for p in unique.values())


def compare(cases: list[tuple[str, str, str | None, int]], args) -> None:
    """Each case (name, model path, quantization, file bytes) as a W1 engine and a concurrency-16 engine,
    measured interleaved --repeats times; a table of the medians against the first case."""
    engines, info = {}, {}
    for name, path, quantization, file_bytes in cases:
        # The KV cache is committed at start, so each of the engines gets what its batch needs (about 23 KiB a
        # token in bf16), not one size for all: 10 engines of 2 GiB did not fit in 24 GB.
        common = dict(model=path, dtype=args.dtype, quantization=quantization, max_model_len=256 + 16,
                      skip_tokenizer_init=True)
        start = time.perf_counter()
        w1 = LLMEngine.from_kwargs(**common, max_num_seqs=256, kv_cache_memory_bytes=(args.w1_requests * 8) << 20)
        load = time.perf_counter() - start
        engines[name] = (w1, LLMEngine.from_kwargs(**common, max_num_seqs=16, kv_cache_memory_bytes=256 << 20))
        info[name] = (file_bytes, weight_bytes(w1), load)
        for engine in engines[name]:
            warm_up(engine, [])
    shape = dict(input_len=128, output_len=128)
    runs = {name: {"w1": [], "c16": []} for name, *_ in cases}
    for repeat in range(args.repeats):
        for i, (name, *_) in enumerate(cases):
            w1, c16 = engines[name]
            runs[name]["w1"].append(run_case(w1, argparse.Namespace(**shape, num_requests=args.w1_requests), [],
                                             100 * repeat + i))
            runs[name]["c16"].append(run_case(c16, argparse.Namespace(**shape, num_requests=64), [],
                                              100 * repeat + 50 + i))
    print(f"# {cpu_kind()}; activations {engines[cases[0][0]][0].runner.dtype}; quantized matmul: "
          f"{quant_gemm.kernel_name()}; {args.repeats} interleaved runs, medians\n")
    print("| weights | file MiB | resident weights MiB | load s | W1 out tok/s | vs float | concurrency 16: "
          "mean TPOT (ms) | per token vs float |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for name, *_ in cases:
        w1 = statistics.median(r["output_tok_s"] for r in runs[name]["w1"])
        tpot = statistics.median(r["tpot_ms"] for r in runs[name]["c16"])
        base = base or (w1, tpot)
        file_bytes, resident, load = info[name]
        print(f"| {name} | {file_bytes / 2**20:.1f} | {resident / 2**20:.1f} | {load:.1f} | {w1:.1f} | "
              f"{w1 / base[0]:.3f}x | {tpot:.1f} | {base[1] / tpot:.2f}x faster |")
    print("\nW1 runs:", {name: [round(r["output_tok_s"], 1) for r in runs[name]["w1"]] for name, *_ in cases})
    print("c16 TPOT runs:", {name: [round(r["tpot_ms"], 1) for r in runs[name]["c16"]] for name, *_ in cases})


def arguments(description: str, **extra: dict) -> argparse.Namespace:
    """The shared flags, and `extra` ones (flag name with underscores -> add_argument keywords)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--w1-requests", type=int, default=256)
    add_kernel_flags(parser)
    for name, options in extra.items():
        parser.add_argument("--" + name.replace("_", "-"), **options)
    return use_kernel_flags(parser.parse_args())


def add_kernel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kernel-flags", default="",
                        help="extra gcc flags for the quantized kernel's build (--kernel-flags='...'), e.g. "
                             "'-mavx512vnni -mavx512vl' with PAGEDSERVE_CPU_ISA=avx2 measures the AVX2 path's 256-bit "
                             "VNNI form on an AVX-512 CPU, '-mno-avxvnni' its maddubs form on an AVX-VNNI one")


def use_kernel_flags(args: argparse.Namespace) -> argparse.Namespace:
    """Builds quant_gemm with --kernel-flags first, so that every quantized layer then uses that build."""
    if args.kernel_flags:
        load_library("quant_gemm", tuple(args.kernel_flags.split()))
    return args


def main() -> None:
    args = arguments(__doc__.split("\n")[0])
    folder = tempfile.mkdtemp()
    cases = [("float weights", default_model_path(), None), ("Q4_1 (the file), kept", default_model_path(), "gguf"),
             ("Q8_0, kept", requantized("Q8_0", folder), "gguf"), ("Q4_0, kept", requantized("Q4_0", folder), "gguf"),
             ("Q4_0 + Q6_K down, kept", requantized("Q4_0", folder, {"ffn_down": "Q6_K"}), "gguf")]
    compare([(name, path, quantization, os.path.getsize(path)) for name, path, quantization in cases], args)


if __name__ == "__main__":
    main()
