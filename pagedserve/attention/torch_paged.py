"""Paged attention in plain PyTorch: correct on any device, the reference for faster backends.

The cache of one layer is a K and a V tensor (layouts in kv_layout.py): one (block, head) pair is a
contiguous tile, so a decode batch gathers its context into the [batch, kv_heads, context, head_dim] layout
that batched matmuls want with one index_select per tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.attention import cpu_decode
from pagedserve.attention.kv_layout import key_tiles_as_rows
from pagedserve.attention.metadata import AttentionMetadata, DecodeBatch, PrefillSeq


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   meta: AttentionMetadata) -> None:
    """Store this step's K/V [num_tokens, kv_heads, head_dim] at their slots."""
    head_dim = value_cache.shape[-1]
    key_cache.view(-1).index_copy_(0, meta.key_element_index(head_dim, key_cache.shape[-1]), key.reshape(-1))
    value_cache.view(-1, head_dim).index_copy_(0, meta.cache_rows, value.reshape(-1, head_dim))


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, meta: AttentionMetadata, kv_cached: bool = False) -> torch.Tensor:
    """Causal attention for a batch mixing single-token decodes and prefill chunks.

    query [T, num_heads, head_dim]; key/value [T, kv_heads, head_dim] (this step's, already rotated; already
    in the cache when `kv_cached`, as the fused rotary kernel leaves them). Returns [T, num_heads * head_dim].
    """
    if not kv_cached:
        write_kv_cache(key, value, key_cache, value_cache, meta)
    if meta.per_token is not None and cpu_decode.supports(query, key_cache):
        # Every token as a decode over the cache up to its own position: causal prefill without gathers, and
        # much faster on CPU than SDPA on short prompts (docs/benchmarks.md).
        pt = meta.per_token
        return cpu_decode.decode_attention(query, key_cache, value_cache, pt.block_tables, pt.context_lens)
    num_tokens, num_heads, head_dim = query.shape
    if meta.decode is not None and not meta.prefills:
        return _decode_attention(query, key_cache, value_cache, meta.decode)
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=query.dtype, device=query.device)
    if meta.decode is not None:
        n = meta.decode.num_seqs
        out[:n] = _decode_attention(query[:n], key_cache, value_cache, meta.decode)
    for group in _fresh_runs(meta.prefills):
        seq = group[0]
        rows = slice(seq.query_start, seq.query_start + len(group) * seq.query_len)
        if seq.block_table is None:  # the whole context is this step's tokens
            out[rows] = _prefill_attention(query[rows], key[rows], value[rows], batch=len(group))
        else:
            k = _gather_sequence(key_cache, seq.block_table, seq.context_len, is_key=True)
            v = _gather_sequence(value_cache, seq.block_table, seq.context_len)
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


def _gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, context_len: int,
                     is_key: bool = False) -> torch.Tensor:
    """One sequence's cached K or V as [context_len, kv_heads, head_dim]."""
    blocks = cache.index_select(0, block_table)
    if is_key:
        blocks = key_tiles_as_rows(blocks)  # [n, kv_heads, block_size, head_dim]
    _, kv_heads, _, head_dim = blocks.shape
    return blocks.permute(0, 2, 1, 3).reshape(-1, kv_heads, head_dim)[:context_len]


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      decode: DecodeBatch) -> torch.Tensor:
    if cpu_decode.supports(query, key_cache):
        return cpu_decode.decode_attention(query, key_cache, value_cache, decode.block_tables, decode.context_lens)
    return decode_attention_torch(query, key_cache, value_cache, decode)


def decode_attention_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           decode: DecodeBatch) -> torch.Tensor:
    """The reference decode path: gather the context tiles, then two batched matmuls."""
    batch, num_heads, head_dim = query.shape
    _, kv_heads, block_size, _ = value_cache.shape
    context = decode.tile_ids.shape[-1] * block_size
    shape = (batch, kv_heads, context, head_dim)
    flat_ids = decode.tile_ids.view(-1)
    k = key_tiles_as_rows(key_cache.view(-1, *key_cache.shape[2:]).index_select(0, flat_ids)).reshape(shape)
    v = value_cache.view(-1, block_size, head_dim).index_select(0, flat_ids).view(shape)
    # Grouped-query attention without repeating K/V: the query heads that share a KV head become that
    # head's rows (one token each, so there is no causal structure to keep).
    q = query.view(batch, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(head_dim ** -0.5).add_(decode.key_bias)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(batch, num_heads * head_dim)


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
