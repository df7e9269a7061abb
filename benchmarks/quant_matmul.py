"""The matmuls of one step of a model, bf16 weights against block-quantized ones, by batch size.

For each row count M, the time of every linear of the decoder layers once, as a step runs them: bf16 through the
small-batch kernel where the engine uses it (M <= 32, or every M where skinny_gemm.takes_every_batch(): the
AVX-512 BF16 layout) or torch (otherwise), against the quantized matmul on weights of the same shapes stored
as the loader stores each GGUF type (random codes; the time does not depend on the values): Q8_0 (kind 8) and
Q4_1 (kind 4) with float16 scales, Q4_0 (kind 4 symmetric: no offsets), and, where every linear's inputs are a
multiple of 256, Q4_K (kind 4) and Q6_K (kind 6) with their super-block scales; otherwise kind 6 with float32
scales in Q6_K's place. --model smollm2-135m (the default model: qkv 576 -> 960, o 576 -> 576, gate_up
576 -> 3072, down 1536 -> 576, 30 layers) or qwen3-0.6b (1024 -> 4096, 2048 -> 1024, 1024 -> 6144, 3072 -> 1024,
28 layers: a model K-quants fit). Every layer has weights of its own, laid out as the engine lays them out (the
bf16 copies packed for small batches and the quantized records each in huge pages), so that a step streams them
from memory as a model's does, not from cache. Medians of --repeats; one process, interleaved.

    python benchmarks/quant_matmul.py [--model smollm2-135m] [--rows 1,16,64,256] [--repeats 5]
                                      [--kernel-flags='-mavx512vnni -mavx512vl']
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from gguf_weights import add_kernel_flags, use_kernel_flags  # beside this file

from pagedserve.benchmarks.cpu_kind import cpu_kind
from pagedserve.executor.cpu_allocator import HugePageArena, huge_page_zeros
from pagedserve.kernels import quant_gemm, skinny_gemm

MODELS = {"smollm2-135m": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
          "qwen3-0.6b": ([(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)], 28)}
"""(out, in) of each layer's qkv, o, gate_up and down, and the number of layers."""


TYPES = {"Q8_0": (8, "half"), "Q4_1": (4, "half"), "Q4_0": (4, "symmetric"), "Q4_K": (4, "super"),
         "Q6_K": (6, "super"), "kind 6, float32 scales": (6, "float32")}
"""Name -> (kind, how the scales are stored), as the loader packs each GGUF type."""


def types_for(shapes) -> list[str]:
    if all(k % 256 == 0 for _, k in shapes):
        return ["Q8_0", "Q4_1", "Q4_0", "Q4_K", "Q6_K"]
    return ["Q8_0", "Q4_1", "Q4_0", "kind 6, float32 scales"]


def quantized(n: int, k: int, name: str, allocate=None) -> quant_gemm.QuantizedWeight:
    kind, storage = TYPES[name]
    codes = torch.randint(-100, 100, (n, k), dtype=torch.int8).view(torch.uint8) if kind == 8 \
        else torch.randint(0, 64 if kind == 6 else 16, (n, k), dtype=torch.uint8)
    per = 16 if kind == 6 else 32
    scales = torch.full((n, k // per), 0.01).half().float()  # float16 values, as a GGUF file's
    offsets = -8 * scales if storage == "symmetric" else torch.full((n, k // 32), -0.07).half().float()
    factors = None
    if storage == "super":
        factors = quant_gemm.SuperScales(torch.full((n, k // 256), 0.001).half(),
                                         torch.full((n, k // per), 10, dtype=torch.uint8),
                                         *((torch.full((n, k // 256), 0.001).half(),
                                            torch.full((n, k // 32), 7, dtype=torch.uint8)) if kind == 4 else ()))
    return quant_gemm.QuantizedWeight.pack(codes, scales, offsets, kind, name, half_scales=storage != "float32",
                                           super_scales=factors, allocate=allocate)


def step_time(linears, x_by_k: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for run, k in linears:
        run(x_by_k[k])
    return time.perf_counter() - start


def packed_bf16(weights: list[tuple[torch.Tensor, int]]) -> list:
    """The small-batch kernel's copies in one huge-page buffer, as LlamaForCausalLM.pack_for_small_batches makes."""
    sizes = [math.prod(skinny_gemm.PackedWeight.packed_shape(w) or (0,)) for w, _ in weights]
    arena = huge_page_zeros(2 * sum(sizes)).view(torch.bfloat16)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(skinny_gemm.PackedWeight.of(w, arena[o:o + n]), k) for (w, k), o, n in zip(weights, offsets, sizes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    add_kernel_flags(parser)
    args = use_kernel_flags(parser.parse_args())
    shapes, layers = MODELS[args.model]
    names = types_for(shapes)
    bf16 = [(torch.randn(n, k).bfloat16(), k) for _ in range(layers) for n, k in shapes]
    packed = packed_bf16(bf16)
    arena = HugePageArena()
    kinds = {name: [(quantized(n, k, name, arena.take), k) for _ in range(layers) for n, k in shapes] for name in names}
    weight_mib = {"bf16": sum(w.numel() * 2 for w, _ in bf16) / 2**20,
                  **{name: sum(q.nbytes for q, _ in ws) / 2**20 for name, ws in kinds.items()}}
    print(f"# {args.model}; {cpu_kind()}; quantized matmul: {quant_gemm.kernel_name()};"
          f" weights per step: " + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in weight_mib.items()) + "\n")
    print("| rows | bf16 ms | " + " | ".join(f"{name} ms | vs bf16" for name in names) + " |")
    print("|---" * (2 + 2 * len(names)) + "|")
    for m in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(m, k).bfloat16() for _, k in shapes}
        if ((m <= skinny_gemm.MAX_ROWS or skinny_gemm.takes_every_batch())
                and all(p is not None for p, _ in packed)):
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
                                                         for kind in names) + " |")


if __name__ == "__main__":
    main()
