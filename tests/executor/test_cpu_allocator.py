"""cpu_allocator: the huge-page buffers behind the KV cache and the packed weights."""

from __future__ import annotations

import pytest
import torch

from pagedserve.executor.cpu_allocator import huge_page_zeros


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
