"""Where a layer's K and V live in its cache tensors.

V: [num_blocks, kv_heads, block_size, head_dim], one contiguous [block_size, head_dim] tile per (block, head).
K: [num_blocks, kv_heads, head_dim // pack, block_size, pack]: each tile is stored transposed, in groups of
`pack` dimensions (pack = 2 for 16-bit dtypes, 1 for float32). Decode attention then computes the scores of
a block's tokens as one vector (a token per lane) by broadcasting the query, with no horizontal sums; in
bfloat16 each 32-bit lane holds a pair of dimensions, the operand layout of AVX-512 BF16 dot products.
(vLLM's CUDA PagedAttention splits its K tiles the same way, with 16-byte groups.)
"""

from __future__ import annotations

import torch


def key_pack(dtype: torch.dtype) -> int:
    """Dimensions stored together per token in a K tile."""
    return 2 if torch.tensor([], dtype=dtype).element_size() == 2 else 1


def key_cache_shape(num_blocks: int, kv_heads: int, block_size: int, head_dim: int,
                    dtype: torch.dtype) -> tuple[int, ...]:
    pack = key_pack(dtype)
    if head_dim % pack:
        raise ValueError(f"head_dim {head_dim} is not a multiple of {pack}")
    return num_blocks, kv_heads, head_dim // pack, block_size, pack


def value_cache_shape(num_blocks: int, kv_heads: int, block_size: int, head_dim: int) -> tuple[int, ...]:
    return num_blocks, kv_heads, block_size, head_dim


def key_tiles_as_rows(tiles: torch.Tensor) -> torch.Tensor:
    """K tiles [..., head_dim // pack, block_size, pack] (a whole cache or gathered blocks) as token rows
    [..., block_size, head_dim]; a copy unless pack is 1."""
    *lead, groups, block_size, pack = tiles.shape
    return tiles.transpose(-3, -2).reshape(*lead, block_size, groups * pack)


def key_element_index(cache_rows: torch.Tensor, block_size: int, head_dim: int, pack: int) -> torch.Tensor:
    """Flat element indices in the K cache for rows `cache_rows` (tile * block_size + offset, as in V's
    [-1, head_dim] view): [len(cache_rows) * head_dim], in (row, dim) order."""
    tiles, offsets = cache_rows // block_size, cache_rows % block_size
    dims = torch.arange(head_dim, device=cache_rows.device)
    within = (dims // pack) * (block_size * pack) + dims % pack  # [head_dim]
    base = tiles * (block_size * head_dim) + offsets * pack  # [rows]
    return (base[:, None] + within[None, :]).reshape(-1)
