"""Prefill attention in tiles (kernels/csrc/prefill_tiles.h): a prompt's tokens, each a decode over the cache up
to its own position, computed together give every token exactly the bits it gets computed alone, and the
attention of plain softmax. Run at every ISA level this CPU can build (tiles exist on avx512_bf16 only; the
other levels check the same equalities on their own paths)."""

import pytest
import torch

from pagedserve.attention import cpu_decode
from pagedserve.attention.kv_layout import key_cache_shape
from pagedserve.attention.metadata import DecodeBatch

from tests.attention.test_decode_attention import naive


@pytest.fixture
def kernel(isa):
    if cpu_decode.load() is None:
        pytest.skip("no C compiler: kernel not built")
    return isa


def per_token_rows(chunks, block_size, num_blocks, generator):
    """Block tables and context lengths of every token of `chunks` [(cached tokens, new tokens) per sequence],
    each token a decode over its sequence's cache up to its own position; or (cached, 0) for a decode row
    attending `cached` tokens. Every sequence gets distinct random blocks."""
    longest = max(cached + new for cached, new in chunks)
    max_blocks = -(-longest // block_size)
    blocks = torch.randperm(num_blocks, generator=generator)[: len(chunks) * max_blocks].view(len(chunks), max_blocks)
    tables, lens = [], []
    for s, (cached, new) in enumerate(chunks):
        for position in range(cached, cached + max(new, 1)):
            tables.append(blocks[s])
            lens.append(position + 1 if new else cached)
    return torch.stack(tables).contiguous(), torch.tensor(lens)


def cache_and_query(heads, kv_heads, head_dim, block_size, tables, num_blocks, generator):
    dtype = torch.bfloat16
    key_cache = torch.randn(key_cache_shape(num_blocks, kv_heads, block_size, head_dim, dtype), generator=generator)
    value_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=generator)
    query = torch.randn(tables.shape[0], heads, head_dim, generator=generator)
    return query.to(dtype), key_cache.to(dtype), value_cache.to(dtype)


def each_row_alone(query, key_cache, value_cache, tables, lens):
    return torch.cat([cpu_decode.decode_attention(query[i:i + 1], key_cache, value_cache, tables[i:i + 1],
                                                  lens[i:i + 1]) for i in range(query.shape[0])])


def assert_together_equals_alone_and_plain_attention(heads, kv_heads, head_dim, block_size, tables, lens,
                                                     num_blocks, generator):
    """Random bf16 queries and caches: the rows computed in one call equal each row computed alone, bit for bit,
    and plain softmax attention within bf16 rounding."""
    query, key_cache, value_cache = cache_and_query(heads, kv_heads, head_dim, block_size, tables, num_blocks,
                                                    generator)
    together = cpu_decode.decode_attention(query, key_cache, value_cache, tables, lens)
    assert torch.equal(together, each_row_alone(query, key_cache, value_cache, tables, lens))
    reference = naive(query, key_cache, value_cache, DecodeBatch(tables, lens, kv_heads, block_size))
    torch.testing.assert_close(together.float(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (8, 2, 128), (16, 1, 64), (6, 1, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prompt_tokens_together_equal_each_token_alone_and_plain_attention(kernel, heads, kv_heads, head_dim,
                                                                           block_size):
    g = torch.Generator().manual_seed(heads * 1000 + head_dim + block_size)
    # fresh prompts of 1, 5, 8 (one tile), 19 and 40 tokens, chunks after 7 and 33 cached tokens, and decodes
    chunks = [(0, 5), (0, 19), (7, 12), (3, 0), (0, 40), (33, 9), (0, 1), (20, 0), (0, 8)]
    num_blocks = 64
    tables, lens = per_token_rows(chunks, block_size, num_blocks, g)
    assert_together_equals_alone_and_plain_attention(heads, kv_heads, head_dim, block_size, tables, lens,
                                                     num_blocks, g)


def test_sequences_sharing_only_a_prefix_of_blocks_are_not_computed_as_one(kernel):
    """Two prompts whose first blocks are the same (a prefix-cache hit) but whose last blocks differ sit next to
    each other: a tile that took one's table for the other would read the wrong K/V."""
    g = torch.Generator().manual_seed(7)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 16, 9, 3, 64
    shared, own = torch.tensor([3, 5]), [torch.tensor([8]), torch.tensor([11])]
    tables = torch.stack([torch.cat([shared, own[0]])] * 4 + [torch.cat([shared, own[1]])] * 4).contiguous()
    lens = torch.tensor([40, 41, 42, 43, 40, 41, 42, 43])  # the second prompt continues at the same positions
    assert_together_equals_alone_and_plain_attention(heads, kv_heads, head_dim, block_size, tables, lens,
                                                     num_blocks, g)


def test_stale_cache_values_past_each_tokens_position_do_not_matter(kernel):
    """A prompt token attends only up to its own position, though its tile's longer rows read further into the
    same blocks: values there (NaN, huge) must change nothing."""
    g = torch.Generator().manual_seed(3)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 8, 9, 3, 64
    tables = torch.tensor([[2, 6]] * 8).contiguous()
    lens = torch.arange(10, 18)
    query, key_cache, value_cache = cache_and_query(heads, kv_heads, head_dim, block_size, tables, num_blocks, g)
    clean = cpu_decode.decode_attention(query, key_cache, value_cache, tables, lens)
    value_cache[6, :, 1:] = float("nan")  # positions 17-31: past every row's context
    key_cache[6, :, :, 1:] = float("nan")
    value_cache[2, :, 15] = 1e30  # position 15: attended only by the rows of length 16 and 17
    dirty = cpu_decode.decode_attention(query, key_cache, value_cache, tables, lens)
    assert torch.equal(dirty[:6], clean[:6])
    assert not torch.isnan(dirty).any()
