"""The matmuls of one step of the default model, bf16 weights against block-quantized ones, by batch size.

For each row count M, the time of every linear of the 30 decoder layers (qkv 576 -> 960, o 576 -> 576, gate_up
576 -> 3072, down 1536 -> 576) once, as a step runs them: bf16 through the small-batch kernel (M <= 32) or
torch (above), against the quantized matmul on weights of the same shapes stored as each GGUF type's are (random
codes; the time does not depend on the values): Q8_0 (kind 8) and Q4_1 (kind 4) with float16 scales, Q4_0 (kind 4
symmetric: no offsets), Q4_K (kind 4, float32 scales: d x a 6-bit scale is no float16) and Q6_K (kind 6, float32
scales). Medians of --repeats; one process, interleaved.

    python benchmarks/quant_matmul.py [--rows 1,16,64,256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.benchmarks.cpu_kind import cpu_kind
from pagedserve.kernels import quant_gemm, skinny_gemm

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
LAYERS = 30


TYPES = {"Q8_0": (8, True, False), "Q4_1": (4, True, False), "Q4_0": (4, True, True), "Q4_K": (4, False, False),
         "Q6_K": (6, False, False)}
"""GGUF type -> (kind, float16 scales, symmetric) as the loader packs it."""


def quantized(n: int, k: int, gguf_type: str) -> quant_gemm.QuantizedWeight:
    kind, half, symmetric = TYPES[gguf_type]
    codes = torch.randint(-100, 100, (n, k), dtype=torch.int8).view(torch.uint8) if kind == 8 \
        else torch.randint(0, 64 if kind == 6 else 16, (n, k), dtype=torch.uint8)
    scales = torch.full((n, k // (16 if kind == 6 else 32)), 0.01)
    offsets = -8 * scales if symmetric else torch.full((n, k // 32), -0.07)  # -0.08 would be -8 x 0.01: symmetric
    return quant_gemm.QuantizedWeight.pack(codes, scales, offsets, kind, gguf_type, half_scales=half)


def step_time(linears, x_by_k: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for _ in range(LAYERS):
        for run, k in linears:
            run(x_by_k[k])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    bf16 = [(torch.randn(n, k).bfloat16(), k) for n, k in SHAPES]
    packed = [(skinny_gemm.PackedWeight.of(w), k) for w, k in bf16]
    kinds = {name: [(quantized(n, k, name), k) for n, k in SHAPES] for name in TYPES}
    weight_mib = {"bf16": sum(w.numel() * 2 for w, _ in bf16) * LAYERS / 2**20,
                  **{name: sum(q.nbytes for q, _ in ws) * LAYERS / 2**20 for name, ws in kinds.items()}}
    print(f"# {cpu_kind()}; quantized matmul: {'AVX512-VNNI int8' if quant_gemm.uses_vnni() else 'float32 tiles'};"
          f" weights per step: " + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in weight_mib.items()) + "\n")
    print("| rows | bf16 ms | " + " | ".join(f"{name} ms | vs bf16" for name in TYPES) + " |")
    print("|---" * (2 + 2 * len(TYPES)) + "|")
    for m in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(m, k).bfloat16() for _, k in SHAPES}
        if m <= skinny_gemm.MAX_ROWS and all(p is not None for p, _ in packed):
            base = [(lambda t, p=p: skinny_gemm.linear(t, p), k) for p, k in packed]
        else:
            base = [(lambda t, w=w: torch.nn.functional.linear(t, w), k) for w, k in bf16]
        cases = {"bf16": base, **{kind: [(lambda t, q=q: quant_gemm.linear(t, q), k) for q, k in ws]
                                  for kind, ws in kinds.items()}}
        times = {name: [] for name in cases}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, linears in cases.items():
                times[name].append(step_time(linears, x))
        ms = {name: 1000 * statistics.median(t[1:]) for name, t in times.items()}
        print(f"| {m} | {ms['bf16']:.2f} | " + " | ".join(f"{ms[kind]:.2f} | {ms['bf16'] / ms[kind]:.2f}x"
                                                         for kind in TYPES) + " |")


if __name__ == "__main__":
    main()
