"""cpu_allocator: the huge-page buffers behind the KV cache and the packed weights."""

from __future__ import annotations

import pytest
import torch

from pagedserve.executor.cpu_allocator import HugePageArena, huge_page_zeros


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def test_huge_page_zeros_is_zeroed_writable_and_exactly_the_size_asked():
    for size in (1, 4095, 3 << 20):
        buffer = huge_page_zeros(size)
        assert buffer.dtype == torch.uint8 and buffer.numel() == size and not buffer.any()
        buffer[-1] = 7
        assert buffer[-1] == 7


def test_huge_page_zeros_gets_transparent_huge_pages_where_the_kernel_gives_them():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        pytest.skip("no transparent huge pages in this kernel")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")
    before = _anon_huge_kib()
    buffer = huge_page_zeros(64 << 20)
    buffer.view(torch.int64)[::512].fill_(1)  # touch every 4 KiB page
    assert _anon_huge_kib() - before >= 32 << 10  # at least half of it in 2 MiB pages


def test_an_arena_hands_out_aligned_disjoint_zeroed_buffers_and_a_new_chunk_when_full():
    arena = HugePageArena(chunk_bytes=1 << 20)
    buffers = [arena.take(size) for size in (100, 5000, 700_000, 400_000, 3 << 20)]
    assert [b.numel() for b in buffers] == [100, 5000, 700_000, 400_000, 3 << 20]
    assert all(b.data_ptr() % 64 == 0 and not b.any() for b in buffers)
    for i, b in enumerate(buffers):
        b.fill_(i + 1)
    assert all(bool((b == i + 1).all()) for i, b in enumerate(buffers))  # none overlaps another
    # the fourth does not fit in the first chunk's tail, the fifth is bigger than a chunk: each got its own
    assert buffers[1].data_ptr() - buffers[0].data_ptr() == 128


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_fresh_buffer_is_lazy_until_touched():
    before = _rss_kib()
    lazy = huge_page_zeros(128 << 20)
    assert _rss_kib() - before < 16 << 10
    lazy[::4096].fill_(1)
    assert _rss_kib() - before > 100 << 10


def test_the_kv_cache_is_committed_when_the_engine_starts(tiny_llama_dir):
    from pagedserve import LLM

    before = _rss_kib()
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=256 << 20)
    grown = _rss_kib() - before
    del llm
    assert grown > 200 << 10, f"RSS grew {grown} KiB for a 256 MiB KV cache"
