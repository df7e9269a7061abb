"""How one step's flattened token batch maps onto sequences and KV-cache slots."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

import torch

from pagedserve.attention.kv_layout import key_element_index


@dataclass
class DecodeBatch:
    """The sequences that compute exactly one token this step; they occupy tokens [0, num_seqs) of the batch."""

    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int64 block ids, padded with 0."""
    context_lens: torch.Tensor
    """[num_seqs] int64: tokens in the cache for each sequence, this step's included."""
    num_kv_heads: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @cached_property
    def tile_ids(self) -> torch.Tensor:
        """[num_seqs, kv_heads, max_blocks]: block_id * kv_heads + head, the cache tiles to read in context
        order (for the torch path, which gathers them; computed once per step, shared by all layers)."""
        heads = torch.arange(self.num_kv_heads, device=self.block_tables.device)
        return (self.block_tables[:, None, :] * self.num_kv_heads + heads[None, :, None]).contiguous()

    @cached_property
    def key_bias(self) -> torch.Tensor:
        """[num_seqs, 1, 1, max_blocks * block_size] float32: 0 inside the context, -inf past its end."""
        positions = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.block_tables.device)
        outside = positions[None, :] >= self.context_lens[:, None]
        bias = torch.zeros(outside.shape, dtype=torch.float32, device=outside.device)
        return bias.masked_fill_(outside, float("-inf")).view(self.num_seqs, 1, 1, -1)


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
    num_kv_heads: int
    block_size: int
    decode: Optional[DecodeBatch] = None
    prefills: list[PrefillSeq] = field(default_factory=list)
    per_token: Optional[DecodeBatch] = None
    """Every token of the step as a decode of its own (its sequence's block table; context = its position + 1),
    for the CPU kernel, which then computes prefill attention causally from the cache like decodes. Set by
    the model runner on CPU only."""
    _key_index: dict = field(default_factory=dict, repr=False)

    @cached_property
    def cache_rows(self) -> torch.Tensor:
        """[num_tokens * kv_heads]: the row of a cache viewed as [-1, head_dim] that each (token, kv head)
        of this step's K/V goes to. Computed once per step; every layer's write is then one index_copy_."""
        blocks = self.slot_mapping // self.block_size
        offsets = self.slot_mapping % self.block_size
        heads = torch.arange(self.num_kv_heads, device=self.slot_mapping.device)
        tiles = blocks[:, None] * self.num_kv_heads + heads[None, :]
        return (tiles * self.block_size + offsets[:, None]).reshape(-1)

    def key_element_index(self, head_dim: int, pack: int) -> torch.Tensor:
        """Flat K-cache element indices of this step's K, [num_tokens * kv_heads * head_dim] (see
        kv_layout.key_element_index); computed once per step, shared by all layers."""
        index = self._key_index.get((head_dim, pack))
        if index is None:
            index = key_element_index(self.cache_rows, self.block_size, head_dim, pack)
            self._key_index[(head_dim, pack)] = index
        return index
