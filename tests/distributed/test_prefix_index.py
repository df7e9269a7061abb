"""The ingress's block hashes are the engine's, and the prefix index remembers whole leading runs per replica."""

from __future__ import annotations

import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.distributed.prefix_index import PrefixIndex, routing_hashes
from pagedserve.sampling_params import SamplingParams


def engine_hashes(tokens: list[int], salt, block_size: int = 4) -> list[bytes]:
    manager = KVCacheManager(num_blocks=64, block_size=block_size)
    request = Request("r", tokens, SamplingParams(max_tokens=1), cache_salt=salt)
    return manager._block_hashes(request, len(tokens))


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_routing_hashes_equal_the_kv_cache_managers_for_full_blocks_only(salt):
    tokens = list(range(10, 24))  # 3 full blocks of 4 and 2 tokens more
    hashes = routing_hashes(tokens, 4, salt)
    assert len(hashes) == 3 and hashes == engine_hashes(tokens, salt)


def test_a_salt_or_an_adapter_changes_every_hash():
    tokens = list(range(8))
    plain = routing_hashes(tokens, 4, None)
    assert not set(plain) & set(routing_hashes(tokens, 4, "a"))
    assert not set(plain) & set(routing_hashes(tokens, 4, None, "adapter"))
    assert routing_hashes(tokens, 4, "a") != routing_hashes(tokens, 4, "b")


def test_match_counts_the_leading_blocks_each_replica_holds():
    index = PrefixIndex()
    a = routing_hashes(list(range(16)), 4, None)
    b = routing_hashes(list(range(8)) + [99] * 8, 4, None)  # shares 2 blocks with a
    index.insert(a, "r1")
    index.insert(b, "r2")
    assert index.match(a, ["r1", "r2", "r3"]) == {"r1": 4, "r2": 2, "r3": 0}
    assert index.match(b, ["r1", "r2"]) == {"r1": 2, "r2": 4}
    assert index.match(routing_hashes([7] * 8, 4, None), ["r1", "r2"]) == {"r1": 0, "r2": 0}


def test_lru_forgets_tails_before_heads_and_old_chains_first():
    index = PrefixIndex(capacity=4)
    old = routing_hashes(list(range(12)), 4, None)
    index.insert(old, "r1")
    new = routing_hashes(list(range(100, 112)), 4, None)
    index.insert(new, "r1")  # 6 hashes into 4 places: old's tail goes first, its head stays runnable
    assert len(index) == 4
    assert index.match(new, ["r1"]) == {"r1": 3}
    assert index.match(old, ["r1"]) == {"r1": 1}


def test_a_dead_replica_is_forgotten_and_others_kept():
    index = PrefixIndex()
    chain = routing_hashes(list(range(8)), 4, None)
    index.insert(chain, "r1")
    index.insert(chain, "r2")
    index.drop_replica("r1")
    assert index.match(chain, ["r1", "r2"]) == {"r1": 0, "r2": 2}
    index.drop_replica("r2")
    assert len(index) == 0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(0)
