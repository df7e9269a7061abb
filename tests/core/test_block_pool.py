import pytest

from pagedserve.core.block_pool import BlockPool


def test_allocate_takes_free_blocks_in_order_with_refcount_one():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.ref_counts[:2] == [1, 1]
    assert pool.num_free_blocks == 2


def test_released_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(4)
    a = pool.allocate(4)
    pool.release([a[2]])
    pool.release([a[0]])
    assert pool.allocate(2) == [a[2], a[0]]


def test_shared_block_returns_to_pool_only_when_last_reference_drops():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.share([b])
    pool.release([b])
    assert pool.num_free_blocks == 1
    pool.release([b])
    assert pool.num_free_blocks == 2


def test_over_allocation_and_double_release_raise():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="only 2 are free"):
        pool.allocate(3)
    [b] = pool.allocate(1)
    pool.release([b])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([b])
    with pytest.raises(RuntimeError, match="is free"):
        pool.share([b])


def test_usage_is_fraction_of_blocks_in_use():
    pool = BlockPool(4)
    pool.allocate(1)
    assert pool.usage() == 0.25
