"""The torch KV write (used where the fused C kernel is not: CUDA, float16, no compiler) puts each token's K
and V where the layout says, so the kernels and the torch readers see the same cache."""

import pytest
import torch

from pagedserve.attention.kv_layout import key_cache_shape, key_tiles_as_rows, value_cache_shape
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_paged import write_kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_cache_stores_each_token_at_its_slot(dtype):
    kv_heads, block_size, head_dim, tokens = 3, 16, 64, 40
    g = torch.Generator().manual_seed(0)
    key = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    key_cache = torch.zeros(key_cache_shape(8, kv_heads, block_size, head_dim, dtype), dtype=dtype)
    value_cache = torch.zeros(value_cache_shape(8, kv_heads, block_size, head_dim), dtype=dtype)
    slots = torch.randperm(8 * block_size, generator=g)[:tokens]
    write_kv_cache(key, value, key_cache, value_cache, AttentionMetadata(slots, kv_heads, block_size))

    def by_slot(rows):  # [blocks, heads, block_size, head_dim] -> [slot, heads, head_dim]
        return rows.permute(0, 2, 1, 3).reshape(-1, kv_heads, head_dim)

    assert torch.equal(by_slot(key_tiles_as_rows(key_cache))[slots], key)
    assert torch.equal(by_slot(value_cache)[slots], value)
    assert key_cache.count_nonzero() == key.count_nonzero()  # nothing written anywhere else
