"""All matmuls of one decode step of the default model, torch's bf16 linear vs the small-batch kernel.

    python benchmarks/small_batch_matmul.py [--rows 1 16 32 64 128]

PAGEDSERVE_CPU_ISA=avx2 measures the AVX2 kernel path on a bigger CPU; to hold torch to AVX2 as well (an
AVX2-only machine), also set ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2.

For each batch size: the 30 layers' q/k/v, o, gate/up and down projections (30 distinct random weights
each, so that they stream from memory as in a real step, not from cache) plus the 49,152 x 576 LM head,
timed with torch.nn.functional.linear and with kernels/skinny_gemm.py on the packed weights.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.kernels import build, skinny_gemm

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # [out, in]; the last is the LM head
LAYERS = 30


def timed(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 128])
    args = parser.parse_args()
    if skinny_gemm.PackedWeight.of(torch.zeros(16, 2, dtype=torch.bfloat16)) is None:
        raise SystemExit(f"the small-batch kernel is not available here (ISA level {build.cpu_isa()}; "
                         "needs AVX2 or AVX-512, and gcc)")
    weights = [[torch.randn(n, k, dtype=torch.bfloat16) for _ in range(1 if n == 49152 else LAYERS)]
               for n, k in SHAPES]
    packed = [[skinny_gemm.PackedWeight.of(w) for w in ws] for ws in weights]
    print(f"threads {torch.get_num_threads()}; kernel ISA {build.cpu_isa()}, torch "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(f"all matmuls of one decode step ({LAYERS} layers + LM head), bf16")
    for rows in args.rows:
        xs = [torch.randn(rows, k, dtype=torch.bfloat16) for _, k in SHAPES]
        torch_s = sum(timed(lambda: [torch.nn.functional.linear(x, w) for w in ws]) for x, ws in zip(xs, weights))
        kernel_s = sum(timed(lambda: [skinny_gemm.linear(x, p) for p in ps]) for x, ps in zip(xs, packed))
        print(f"{rows:4d} rows: torch {torch_s * 1e3:6.1f} ms   small-batch kernel {kernel_s * 1e3:6.1f} ms   "
              f"({torch_s / kernel_s:.2f}x)")


if __name__ == "__main__":
    main()
