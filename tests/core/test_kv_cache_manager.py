from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt: int) -> Request:
    return Request(request_id, list(range(num_prompt)), SamplingParams())


def test_blocks_are_taken_as_tokens_arrive():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", 5)
    assert kv.allocate_slots(req, 5)
    assert len(kv.get_block_ids("a")) == 2
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 3)  # tokens 5..7 still fit in block 2
    assert len(kv.get_block_ids("a")) == 2
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1)
    assert len(kv.get_block_ids("a")) == 3


def test_allocation_fails_without_side_effects_when_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = make_request("a", 9)
    assert not kv.allocate_slots(req, 9)
    assert kv.num_free_blocks == 2


def test_free_returns_every_block():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request("a", 16)
    assert kv.allocate_slots(req, 16)
    assert kv.num_free_blocks == 0
    kv.free(req)
    assert kv.num_free_blocks == 4
    assert kv.get_block_ids("a") == []
