"""Paged attention in plain PyTorch: correct on any device, the reference for faster backends.

The cache of one layer is a K and a V tensor of shape [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.attention.metadata import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V [num_tokens, kv_heads, head_dim] at their slots."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Causal attention for a batch mixing single-token decodes and prefill chunks.

    query [T, num_heads, head_dim]; key/value [T, kv_heads, head_dim] (this step's, already rotated).
    Returns [T, num_heads * head_dim].
    """
    write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=query.dtype, device=query.device)
    if meta.decode is not None:
        n = meta.decode.num_seqs
        out[:n] = _decode_attention(query[:n], key_cache, value_cache, meta.decode.block_tables,
                                    meta.decode.key_mask)
    for seq in meta.prefills:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        if seq.block_table is None:  # the whole context is this step's tokens
            out[rows] = _prefill_attention(query[rows], key[rows], value[rows])
        else:
            k, v = _gather_blocks(key_cache, value_cache, seq.block_table.unsqueeze(0))
            k, v = k[0, :seq.context_len], v[0, :seq.context_len]
            out[rows] = _prefill_attention(query[rows], k, v, past=seq.context_len - seq.query_len)
    return out


def _gather_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor):
    """[B, max_blocks] block ids -> K and V of shape [B, max_blocks * block_size, kv_heads, head_dim]."""
    batch, max_blocks = block_tables.shape
    _, block_size, kv_heads, head_dim = key_cache.shape
    flat = block_tables.reshape(-1)
    shape = (batch, max_blocks * block_size, kv_heads, head_dim)
    return key_cache.index_select(0, flat).view(shape), value_cache.index_select(0, flat).view(shape)


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    batch, num_heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    k, v = _gather_blocks(key_cache, value_cache, block_tables)
    # Grouped-query attention without repeating K/V: the query heads that share a KV head become that
    # head's "query positions" (one token each, so no causal structure is lost).
    q = query.view(batch, kv_heads, num_heads // kv_heads, head_dim)
    o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask)
    return o.reshape(batch, num_heads * head_dim)


def _prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: int = 0) -> torch.Tensor:
    """query [q, H, d] attends key/value [past + q, KVH, d] causally (query i sits at position past + i)."""
    q_len, num_heads, head_dim = query.shape
    kv_len, kv_heads, _ = key.shape
    q = query.transpose(0, 1).unsqueeze(0)
    k = key.transpose(0, 1).unsqueeze(0)
    v = value.transpose(0, 1).unsqueeze(0)
    if past == 0:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != num_heads)
    else:
        q_pos = torch.arange(past, past + q_len, device=query.device)
        mask = torch.arange(kv_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != num_heads)
    return o[0].transpose(0, 1).reshape(q_len, num_heads * head_dim)
