"""The C decode kernel equals the torch reference path, and both equal plain softmax attention. The kernel
tests run at every ISA level of kernels/build.py that this CPU can run (AVX-512, AVX2 and plain C paths)."""

import pytest
import torch

from pagedserve.attention import cpu_decode
from pagedserve.attention.kv_layout import key_tiles_as_rows, key_cache_shape
from pagedserve.attention.metadata import DecodeBatch
from pagedserve.attention.torch_paged import decode_attention_torch


@pytest.fixture
def kernel(isa):
    """The kernel built for each ISA level this CPU can run (conftest's `isa`)."""
    if cpu_decode.load() is None:
        pytest.skip("no C compiler: kernel not built")
    return isa


def random_batch(dtype, batch=7, heads=6, kv_heads=2, head_dim=32, block_size=4, num_blocks=64, seed=0,
                 max_context=23):
    g = torch.Generator().manual_seed(seed)
    num_blocks = max(num_blocks, batch * -(-max_context // block_size))
    key_cache = torch.randn(key_cache_shape(num_blocks, kv_heads, block_size, head_dim, dtype), generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    context_lens = torch.randint(1, max_context, (batch,), generator=g)
    max_blocks = int(-(-context_lens.max() // block_size))
    # distinct random blocks per sequence, padded with 0 past the context
    perm = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks)
    query = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    return query, key_cache, value_cache, DecodeBatch(perm.contiguous(), context_lens, kv_heads, block_size)


def naive(query, key_cache, value_cache, decode):
    out = []
    kv_heads, block_size = value_cache.shape[1], value_cache.shape[2]
    key_cache = key_tiles_as_rows(key_cache)
    for b in range(query.shape[0]):
        n = int(decode.context_lens[b])
        blocks = decode.block_tables[b, : -(-n // block_size)]
        k = key_cache[blocks].permute(1, 0, 2, 3).reshape(kv_heads, -1, key_cache.shape[-1])[:, :n].float()
        v = value_cache[blocks].permute(1, 0, 2, 3).reshape(kv_heads, -1, key_cache.shape[-1])[:, :n].float()
        group = query.shape[1] // kv_heads
        q = query[b].float().view(kv_heads, group, -1)
        p = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, -1)
        out.append((p @ v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_torch_path_matches_naive_attention(dtype, tol):
    q, kc, vc, decode = random_batch(dtype)
    assert torch.allclose(decode_attention_torch(q, kc, vc, decode).float(), naive(q, kc, vc, decode), atol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
# groups of 5 and 8 query heads a KV head: the AVX2 path's score pass takes at most 4 heads at a time
@pytest.mark.parametrize("heads,kv_heads,head_dim",
                         [(6, 2, 32), (4, 4, 64), (9, 3, 64), (4, 2, 128), (10, 2, 64), (16, 2, 128)])
# For head_dim 64/128, 8 takes the AVX2 path (avx2 level), 16 and 32 the AVX-512 or AVX2 one; 4 the plain C loop.
@pytest.mark.parametrize("block_size", [4, 8, 16, 32])
def test_kernel_matches_naive_attention(kernel, dtype, tol, heads, kv_heads, head_dim, block_size):
    q, kc, vc, decode = random_batch(dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                     block_size=block_size, max_context=100)
    out = cpu_decode.decode_attention(q, kc, vc, decode.block_tables, decode.context_lens)
    assert out.dtype == dtype
    assert torch.allclose(out.float(), naive(q, kc, vc, decode), atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim", [(4, 32), (8, 128), (16, 64)])
def test_kernel_ignores_stale_values_past_the_context(kernel, dtype, block_size, head_dim):
    q, kc, vc, decode = random_batch(dtype, block_size=block_size, head_dim=head_dim, max_context=60)
    before = cpu_decode.decode_attention(q, kc, vc, decode.block_tables, decode.context_lens)
    kc_dirty, vc_dirty = kc.clone(), vc.clone()
    used = set()
    for b in range(q.shape[0]):
        n = int(decode.context_lens[b])
        for t in range(n):
            used.add((int(decode.block_tables[b, t // block_size]), t % block_size))
    for blk in range(kc.shape[0]):
        for off in range(block_size):
            if (blk, off) not in used:
                kc_dirty[blk, :, :, off] = float("nan")  # K tiles: [groups, block_size, pack]
                vc_dirty[blk, :, off] = float("nan")
    after = cpu_decode.decode_attention(q, kc_dirty, vc_dirty, decode.block_tables, decode.context_lens)
    assert torch.equal(before, after)
