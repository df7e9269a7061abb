"""float32 matmuls of the default model's shapes: torch's linear (MKL's sgemm) vs the packed kernel
(kernels/f32_gemm.py), side by side, GFLOP/s per shape.

    python benchmarks/f32_matmul.py [--rows 1 16 256 2048] [--rounds 4]

The packed kernel has a path at the avx2 level only (CPUs with AVX2 + FMA and no AVX-512); on a bigger CPU,
PAGEDSERVE_CPU_ISA=avx2 runs it, and ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 hold torch to AVX2 as well
(MKL may still use AVX-512: only an AVX2-only machine gives the real comparison). Each shape is timed in rounds,
torch and the kernel alternately, and the median round is printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.benchmarks.cpu_kind import cpu_kind
from pagedserve.kernels import build, f32_gemm

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}  # [out, in]


def gflops(fn, flop: float, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return flop * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 2048])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if not f32_gemm.available():
        raise SystemExit(f"the packed float32 kernel has no path here (ISA level {build.cpu_isa()}; it runs at "
                         "the avx2 level: set PAGEDSERVE_CPU_ISA=avx2 on an AVX-512 CPU)")
    print(f"CPU {cpu_kind()}; threads {torch.get_num_threads()}; kernel ISA {build.cpu_isa()}, torch "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print("GFLOP/s, torch -> packed (median of rounds)")
    for rows in args.rows:
        cells = []
        for name, (n, k) in SHAPES.items():
            weight, x = torch.randn(n, k) * 0.05, torch.randn(rows, k)
            packed = f32_gemm.PackedWeight.of(weight)
            flop = 2.0 * rows * n * k
            repeats = max(2, int(3e9 / flop))
            torch_rates, packed_rates = [], []
            for _ in range(args.rounds):
                torch_rates.append(gflops(lambda: torch.nn.functional.linear(x, weight), flop, repeats))
                packed_rates.append(gflops(lambda: f32_gemm.linear(x, packed), flop, repeats))
            a, b = statistics.median(torch_rates), statistics.median(packed_rates)
            cells.append(f"{name} {a:.1f} -> {b:.1f} ({b / a:.2f}x)")
        print(f"{rows:5d} rows: " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
