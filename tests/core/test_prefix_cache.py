"""Prefix caching in the KV-cache manager: hash chains, reuse of leading blocks, LRU eviction, salts."""

from pagedserve.core.kv_cache_manager import KVCacheManager, hash_block
from pagedserve.core.request import Request
from pagedserve.sampling_params import SamplingParams

BS = 4


def req(request_id, tokens, salt=None) -> Request:
    return Request(request_id, tokens, SamplingParams(), cache_salt=salt)


def run_prefill(kv: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does for a waiting request: take cached blocks, allocate the rest, compute."""
    cached = kv.get_computed_blocks(request)
    request.num_computed_tokens = len(cached) * BS
    assert kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens, cached)
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    return cached


def test_hash_chain_depends_on_every_earlier_token_and_the_salt():
    a = hash_block(None, [1, 2, 3, 4], None)
    assert hash_block(None, [1, 2, 3, 4], None) == a
    assert hash_block(a, [5, 6, 7, 8], None) != hash_block(hash_block(None, [9, 2, 3, 4], None), [5, 6, 7, 8], None)
    assert hash_block(None, [1, 2, 3, 4], "tenant-a") != a
    assert hash_block(None, [1, 2, 3, 4], "tenant-a") != hash_block(None, [1, 2, 3, 4], "tenant-b")


def test_second_request_reuses_leading_full_blocks_by_exact_id():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    first = req("a", list(range(10)))  # blocks 0,1 full, block 2 partial
    assert run_prefill(kv, first) == []
    assert kv.get_block_ids("a") == [0, 1, 2]
    second = req("b", list(range(8)) + [99, 98, 97])
    assert run_prefill(kv, second) == [0, 1]  # shares the two full blocks
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert kv.pool.ref_counts[:4] == [2, 2, 1, 1]


def test_the_last_prompt_token_is_always_computed():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    run_prefill(kv, req("a", list(range(8))))
    # The same 8 tokens again: only the first block may come from the cache (the last token needs logits).
    assert kv.get_computed_blocks(req("b", list(range(8)))) == [0]
    assert kv.get_computed_blocks(req("c", list(range(9)))) == [0, 1]


def test_freed_blocks_stay_cached_and_are_evicted_least_recently_used_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a, b = req("a", list(range(5))), req("b", list(range(100, 105)))
    run_prefill(kv, a)  # blocks 0 (full, cached), 1
    run_prefill(kv, b)  # blocks 2 (full, cached), 3
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 4
    assert kv.pool.cached == {hash_block(None, [0, 1, 2, 3], None): 0,
                              hash_block(None, [100, 101, 102, 103], None): 2}
    # Free order was a's tail (1), a's head (0), b's tail (3), b's head (2): allocating two new blocks
    # takes 1 and then 0, evicting a's cached block; b's stays.
    c = req("c", list(range(200, 208)))
    run_prefill(kv, c)
    assert kv.get_block_ids("c") == [1, 0]
    assert kv.get_computed_blocks(req("a2", list(range(5)))) == []
    assert kv.get_computed_blocks(req("b2", list(range(100, 105)))) == [2]


def test_a_cache_hit_on_a_free_block_takes_it_out_of_the_free_queue():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = req("a", list(range(5)))
    run_prefill(kv, a)
    kv.free(a)
    b = req("b", list(range(6)))
    assert run_prefill(kv, b) == [0]
    assert kv.pool.ref_counts[0] == 1 and kv.num_free_blocks == 1
    assert not kv.allocate_slots(req("c", [7] * 9), 9)  # needs 3 blocks, 1 is free: nothing changes
    assert kv.num_free_blocks == 1


def test_different_salts_never_share_a_block():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    run_prefill(kv, req("a", list(range(9)), salt="key-1"))
    assert kv.get_computed_blocks(req("b", list(range(9)), salt="key-2")) == []
    assert kv.get_computed_blocks(req("c", list(range(9)))) == []
    assert kv.get_computed_blocks(req("d", list(range(9)), salt="key-1")) == [0, 1]


def test_prefix_caching_off_never_reuses():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    run_prefill(kv, req("a", list(range(9))))
    assert kv.get_computed_blocks(req("b", list(range(9)))) == []
    assert kv.pool.cached == {}


def test_reset_prefix_cache_forgets_cached_blocks_only_when_none_is_in_use():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    first = req("a", list(range(9)))
    run_prefill(kv, first)
    assert not kv.reset_prefix_cache()  # "a" still holds its blocks
    kv.free(first)
    assert run_prefill(kv, second := req("b", list(range(9))))  # still cached
    kv.free(second)
    assert kv.reset_prefix_cache()
    assert run_prefill(kv, req("c", list(range(9)))) == []
