"""Decode attention for one layer: the C kernel vs the torch gather path, side by side.

    python benchmarks/decode_attention.py [--batch 256 --context 192 --dtype bfloat16]

Shapes default to SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, blocks of 16).
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.attention import cpu_decode
from pagedserve.attention.kv_layout import key_cache_shape
from pagedserve.attention.metadata import DecodeBatch
from pagedserve.attention.torch_paged import decode_attention_torch
from pagedserve.executor.cpu_allocator import keep_freed_memory


def timed(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=192)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = p.parse_args()
    keep_freed_memory()  # as the engine does
    dtype = getattr(torch, a.dtype)
    blocks_per_seq = -(-a.context // a.block_size)
    num_blocks = a.batch * blocks_per_seq
    key_cache = torch.randn(key_cache_shape(num_blocks, a.kv_heads, a.block_size, a.head_dim, dtype)).to(dtype)
    value_cache = torch.randn(num_blocks, a.kv_heads, a.block_size, a.head_dim).to(dtype)
    tables = torch.randperm(num_blocks).view(a.batch, blocks_per_seq).contiguous()
    decode = DecodeBatch(tables, torch.full((a.batch,), a.context), a.kv_heads, a.block_size)
    query = torch.randn(a.batch, a.heads, a.head_dim).to(dtype)
    torch_ms = timed(lambda: decode_attention_torch(query, key_cache, value_cache, decode))
    print(f"torch path: {torch_ms:.2f} ms")
    if cpu_decode.supports(query, key_cache):
        kernel_ms = timed(lambda: cpu_decode.decode_attention(query, key_cache, value_cache, tables,
                                                              decode.context_lens))
        print(f"C kernel:   {kernel_ms:.2f} ms  ({torch_ms / kernel_ms:.2f}x)")
    else:
        print("C kernel: not available here")


if __name__ == "__main__":
    main()
