"""Roofline for workload W1 on this machine: measured matmul rate and memory bandwidth vs the work W1 needs.

    python benchmarks/roofline.py [--dtype bfloat16|float32] [--num-prompts 256 --input-len 128 --output-len 128]

Prints the GEMM rate on the default model's own shapes (256 rows, as in a full decode batch, and 2048 rows, as
in a prefill step), the copy and read bandwidths, the FLOPs one W1 run needs (from the model's config), the
output tok/s that the matmul rate alone allows (no engine can beat that bound on this machine), and the FLOPs
and bytes of one steady decode step.

The GEMM rate is measured twice in bfloat16: torch's linear (the BLAS that vLLM's CPU build also runs) and
pagedserve's packed kernel (kernels/skinny_gemm.py, which bf16 layers use for every batch on AVX-512 BF16
CPUs). The bound takes the faster of the two at each row count: on a CPU where the packed kernel is well ahead
(AMD Zen 5: 2 BF16 dot products a cycle), a bound from torch's rate would be one that engines already beat.
"""

from __future__ import annotations

import argparse
import time

import torch


def gemm_rate(rows: int, shapes: list[tuple[int, int]], dtype: torch.dtype, repeats: int = 10) -> float:
    """GFLOP/s of x[rows, k] @ w[n, k]^T summed over the shapes, as one forward pass would run them."""
    pairs = [(torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype)) for n, k in shapes]
    for x, w in pairs:
        torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for _ in range(repeats):
        for x, w in pairs:
            torch.nn.functional.linear(x, w)
    seconds = (time.perf_counter() - start) / repeats
    return sum(2 * rows * n * k for n, k in shapes) / seconds / 1e9


def packed_gemm_rate(rows: int, shapes: list[tuple[int, int]], repeats: int = 10) -> float | None:
    """GFLOP/s of the same matmuls through pagedserve's packed bf16 kernel, or None where it has no path."""
    from pagedserve.kernels import skinny_gemm

    pairs = [(torch.randn(rows, k, dtype=torch.bfloat16), skinny_gemm.PackedWeight.of(torch.randn(n, k).bfloat16()))
             for n, k in shapes]
    if any(packed is None for _, packed in pairs):
        return None
    for x, packed in pairs:
        skinny_gemm.linear(x, packed)
    start = time.perf_counter()
    for _ in range(repeats):
        for x, packed in pairs:
            skinny_gemm.linear(x, packed)
    seconds = (time.perf_counter() - start) / repeats
    return sum(2 * rows * n * k for n, k in shapes) / seconds / 1e9


def read_bandwidth(num_bytes: int = 256 << 20, repeats: int = 10) -> float:
    """GB/s of reading a large buffer once (a sum over it): what attention's KV reads can get at best."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    src.sum()
    start = time.perf_counter()
    for _ in range(repeats):
        src.sum()
    return num_bytes * repeats / (time.perf_counter() - start) / 1e9


def copy_bandwidth(num_bytes: int = 256 << 20, repeats: int = 10) -> float:
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return 2 * num_bytes * repeats / (time.perf_counter() - start) / 1e9  # read + write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    from pagedserve.loader.model_loader import open_checkpoint

    c = open_checkpoint(args.model).config
    h, inter, layers, vocab = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    layer_shapes = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]  # fused qkv, o, gate_up, down
    layer_params = sum(n * k for n, k in layer_shapes) * layers
    dtype = getattr(torch, args.dtype)

    decode_rate = torch_decode_rate = gemm_rate(256, layer_shapes + [(vocab, h)], dtype)
    prefill_rate = torch_prefill_rate = gemm_rate(2048, layer_shapes, dtype)
    packed = None
    if dtype == torch.bfloat16:
        packed = (packed_gemm_rate(256, layer_shapes + [(vocab, h)]), packed_gemm_rate(2048, layer_shapes))
        if packed[0] is not None:
            decode_rate, prefill_rate = max(decode_rate, packed[0]), max(prefill_rate, packed[1])
    bandwidth = copy_bandwidth()
    read_bw = read_bandwidth()

    n, p, o = args.num_prompts, args.input_len, args.output_len
    prefill_flops = 2 * layer_params * n * p
    decode_flops = 2 * layer_params * n * (o - 1)
    lm_head_flops = 2 * vocab * h * n * o
    ctx = p + o / 2
    attn_flops = layers * c.num_attention_heads * head_dim * 4 * n * (o * ctx + p * p / 2)
    total = prefill_flops + decode_flops + lm_head_flops + attn_flops
    bound_s = (prefill_flops + attn_flops / 2) / (prefill_rate * 1e9) + (decode_flops + lm_head_flops + attn_flops / 2) / (decode_rate * 1e9)

    print(f"threads {torch.get_num_threads()}  dtype {args.dtype}")
    print(f"GEMM rate, model shapes, 256 rows (decode step):  {torch_decode_rate:7.1f} GFLOP/s torch" +
          (f", {packed[0]:7.1f} packed kernel" if packed and packed[0] else ""))
    print(f"GEMM rate, model shapes, 2048 rows (prefill step): {torch_prefill_rate:7.1f} GFLOP/s torch" +
          (f", {packed[1]:7.1f} packed kernel" if packed and packed[1] else ""))
    print(f"copy bandwidth (read + write):                     {bandwidth:7.1f} GB/s")
    print(f"W1 work: prefill {prefill_flops / 1e12:.2f} + decode {decode_flops / 1e12:.2f} + lm_head "
          f"{lm_head_flops / 1e12:.2f} + attention {attn_flops / 1e12:.2f} = {total / 1e12:.2f} TFLOP")
    print(f"matmul-bound time at the faster rates ({decode_rate:.0f} / {prefill_rate:.0f} GFLOP/s) {bound_s:.1f} s "
          f"-> at most {n * o / bound_s:.0f} output tok/s")

    # One steady decode step of W1: all n sequences at the mean context.
    elem = torch.tensor([], dtype=dtype).element_size()
    step_flops = 2 * (layer_params + vocab * h) * n + layers * c.num_attention_heads * head_dim * 4 * n * ctx
    weight_bytes = (layer_params + vocab * h) * elem
    kv_bytes = layers * 2 * c.num_key_value_heads * head_dim * elem * n * ctx
    matmul_ms = 2 * (layer_params + vocab * h) * n / (decode_rate * 1e9) * 1e3
    memory_ms = (weight_bytes + kv_bytes) / (read_bw * 1e9) * 1e3
    print(f"read bandwidth:                                    {read_bw:7.1f} GB/s")
    print(f"one decode step ({n} seqs, context {ctx:.0f}): {step_flops / 1e9:.1f} GFLOP, weights "
          f"{weight_bytes / 1e6:.0f} MB + KV reads {kv_bytes / 1e6:.0f} MB; matmuls alone {matmul_ms:.0f} ms at the "
          f"GEMM rate, KV + weight reads alone {memory_ms:.0f} ms at the read bandwidth")


if __name__ == "__main__":
    main()
