"""How one step's flattened token batch maps onto sequences and KV-cache slots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class DecodeBatch:
    """The sequences that compute exactly one token this step; they occupy tokens [0, num_seqs) of the batch."""

    num_seqs: int
    tile_ids: torch.Tensor
    """[num_seqs, kv_heads, max_blocks] int64: block_id * kv_heads + head, the cache tiles to read, in
    context order (padded with tile 0)."""
    key_bias: torch.Tensor
    """[num_seqs, 1, 1, max_blocks * block_size] float32: 0 inside the context, -inf past its end."""


@dataclass
class PrefillSeq:
    """A sequence that computes several tokens this step (a prompt or a chunk of one)."""

    query_start: int
    query_len: int
    context_len: int
    """Tokens in the cache for this sequence after this step (earlier chunks + this one)."""
    block_table: Optional[torch.Tensor] = None
    """[num_blocks] int64 block ids; only set when earlier tokens must be read back from the cache."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] int64: the cache slot (block_id * block_size + offset) each new token's K/V goes to."""
    decode: Optional[DecodeBatch] = None
    prefills: list[PrefillSeq] = field(default_factory=list)
