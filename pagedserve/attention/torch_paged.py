"""Paged attention in plain PyTorch: correct on any device, the reference for faster backends.

The cache of one layer is a K and a V tensor (layouts in kv_layout.py): one (block, head) pair is a
contiguous tile, so a decode batch gathers its context into the [batch, kv_heads, context, head_dim] layout
that batched matmuls want with one index_select per tensor.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedserve.attention import cpu_decode
from pagedserve.attention.kv_layout import key_tiles_as_rows
from pagedserve.attention.metadata import AttentionMetadata, DecodeBatch, PrefillSeq
from pagedserve.quantization import kv_cache as kv_quant


KVScales = Optional[tuple[torch.Tensor, torch.Tensor]]
"""An 8-bit cache's (key, value) bf16 scales [num_blocks, kv_heads, block_size]; None for a float cache."""


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   meta: AttentionMetadata, kv_scales: KVScales = None) -> None:
    """Store this step's K/V [num_tokens, kv_heads, head_dim] at their slots (quantized, with their scales,
    into an 8-bit cache)."""
    head_dim = value_cache.shape[-1]
    key_index = meta.key_element_index(head_dim, key_cache.shape[-1])
    if kv_scales is None:
        key_cache.view(-1).index_copy_(0, key_index, key.reshape(-1))
        value_cache.view(-1, head_dim).index_copy_(0, meta.cache_rows, value.reshape(-1, head_dim))
        return
    (key_codes, key_scale), (value_codes, value_scale) = (kv_quant.quantize(x, key_cache.dtype) for x in (key, value))
    key_cache.view(torch.uint8).view(-1).index_copy_(0, key_index, key_codes.view(torch.uint8).reshape(-1))
    value_cache.view(torch.uint8).view(-1, head_dim).index_copy_(
        0, meta.cache_rows, value_codes.view(torch.uint8).reshape(-1, head_dim))
    for scales, new in zip(kv_scales, (key_scale, value_scale)):
        scales.view(-1).index_copy_(0, meta.cache_rows, new.reshape(-1))


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, meta: AttentionMetadata, kv_cached: bool = False,
                    kv_scales: KVScales = None) -> torch.Tensor:
    """Causal attention for a batch mixing single-token decodes and prefill chunks.

    query [T, num_heads, head_dim]; key/value [T, kv_heads, head_dim] (this step's, already rotated; already
    in the cache when `kv_cached`, as the fused rotary kernel leaves them). Returns [T, num_heads * head_dim].
    With an 8-bit cache every token attends to the cached (quantized) K/V, this step's too, so a result does
    not depend on how a prompt was split into chunks.
    """
    if not kv_cached:
        write_kv_cache(key, value, key_cache, value_cache, meta, kv_scales)
    if meta.per_token is not None and cpu_decode.supports(query, key_cache):
        # Every token as a decode over the cache up to its own position: causal prefill without gathers, and
        # much faster on CPU than SDPA on short prompts (docs/benchmarks.md).
        pt = meta.per_token
        return cpu_decode.decode_attention(query, key_cache, value_cache, pt.block_tables, pt.context_lens,
                                           kv_scales)
    num_tokens, num_heads, head_dim = query.shape
    if meta.decode is not None and not meta.prefills:
        return _decode_attention(query, key_cache, value_cache, meta.decode, kv_scales)
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=query.dtype, device=query.device)
    if meta.decode is not None:
        n = meta.decode.num_seqs
        out[:n] = _decode_attention(query[:n], key_cache, value_cache, meta.decode, kv_scales)
    if kv_scales is not None:  # attention over the dequantized values, computed in float32
        key, value = kv_quant.roundtrip(key, key_cache.dtype), kv_quant.roundtrip(value, key_cache.dtype)
        query = query.float()
    for group in _fresh_runs(meta.prefills):
        seq = group[0]
        rows = slice(seq.query_start, seq.query_start + len(group) * seq.query_len)
        if seq.block_table is None:  # the whole context is this step's tokens
            out[rows] = _prefill_attention(query[rows], key[rows], value[rows], batch=len(group))
        else:
            key_scale, value_scale = kv_scales or (None, None)
            k = _gather_sequence(key_cache, seq.block_table, seq.context_len, query.dtype, key_scale, True)
            v = _gather_sequence(value_cache, seq.block_table, seq.context_len, query.dtype, value_scale, False)
            out[rows] = _prefill_attention(query[rows], k, v, past=seq.context_len - seq.query_len)
    return out


def _fresh_runs(prefills: list[PrefillSeq]) -> list[list[PrefillSeq]]:
    """Prefills in order, with adjacent fresh prompts (nothing cached before them) of equal length grouped:
    each group is one batched attention call instead of one call per prompt."""
    groups: list[list[PrefillSeq]] = []
    for seq in prefills:
        last = groups[-1][-1] if groups else None
        if (seq.block_table is None and last is not None and last.block_table is None
                and last.query_len == seq.query_len and last.query_start + last.query_len == seq.query_start):
            groups[-1].append(seq)
        else:
            groups.append([seq])
    return groups


def _gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, context_len: int, dtype: torch.dtype,
                     scales: Optional[torch.Tensor], is_key: bool) -> torch.Tensor:
    """One sequence's cached K or V as [context_len, kv_heads, head_dim] in `dtype`."""
    if scales is None:
        blocks = cache.index_select(0, block_table)
    else:
        blocks = cache.view(torch.uint8).index_select(0, block_table).view(cache.dtype)
    if is_key:
        blocks = key_tiles_as_rows(blocks)  # [n, kv_heads, block_size, head_dim]
    if scales is not None:
        blocks = kv_quant.dequantize(blocks, scales.index_select(0, block_table), dtype)
    _, kv_heads, _, head_dim = blocks.shape
    return blocks.permute(0, 2, 1, 3).reshape(-1, kv_heads, head_dim)[:context_len]


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      decode: DecodeBatch, kv_scales: KVScales = None) -> torch.Tensor:
    if cpu_decode.supports(query, key_cache):
        return cpu_decode.decode_attention(query, key_cache, value_cache, decode.block_tables, decode.context_lens,
                                           kv_scales)
    return decode_attention_torch(query, key_cache, value_cache, decode, kv_scales)


def decode_attention_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           decode: DecodeBatch, kv_scales: KVScales = None) -> torch.Tensor:
    """The reference decode path: gather the context tiles (dequantizing 8-bit ones), then two batched matmuls."""
    batch, num_heads, head_dim = query.shape
    _, kv_heads, block_size, _ = value_cache.shape
    context = decode.tile_ids.shape[-1] * block_size
    shape = (batch, kv_heads, context, head_dim)
    flat_ids = decode.tile_ids.view(-1)
    k_tiles = _tiles(key_cache, kv_scales is not None).view(-1, *key_cache.shape[2:]).index_select(0, flat_ids)
    k = key_tiles_as_rows(k_tiles.view(key_cache.dtype))
    v = _tiles(value_cache, kv_scales is not None).view(-1, block_size, head_dim).index_select(0, flat_ids)
    v = v.view(value_cache.dtype)
    q = query
    if kv_scales is not None:  # attention over the dequantized values, computed in float32
        k, v = (kv_quant.dequantize(x, s.view(-1, block_size).index_select(0, flat_ids))
                for x, s in ((k, kv_scales[0]), (v, kv_scales[1])))
        q = query.float()
    k, v = k.reshape(shape), v.reshape(shape)
    # Grouped-query attention without repeating K/V: the query heads that share a KV head become that
    # head's rows (one token each, so there is no causal structure to keep).
    q = q.view(batch, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(head_dim ** -0.5).add_(decode.key_bias)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(batch, num_heads * head_dim).to(query.dtype)


def _tiles(cache: torch.Tensor, quantized: bool) -> torch.Tensor:
    """The cache as something index_select can gather from (8-bit caches through their bytes)."""
    return cache.view(torch.uint8) if quantized else cache


def _prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: int = 0,
                       batch: int = 1) -> torch.Tensor:
    """query [q, H, d] attends key/value [past + q, KVH, d] causally (query i sits at position past + i).
    With batch > 1 (past 0), the rows are `batch` independent prompts of equal length, one after another."""
    total, num_heads, head_dim = query.shape
    kv_heads = key.shape[1]
    q_len = total // batch
    q = query.view(batch, q_len, num_heads, head_dim).transpose(1, 2)
    k = key.reshape(batch, -1, kv_heads, head_dim).transpose(1, 2)
    v = value.reshape(batch, -1, kv_heads, head_dim).transpose(1, 2)
    if past == 0:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != num_heads)
    else:
        q_pos = torch.arange(past, past + q_len, device=query.device)
        mask = torch.arange(k.shape[2], device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != num_heads)
    return o.transpose(1, 2).reshape(total, num_heads * head_dim)
