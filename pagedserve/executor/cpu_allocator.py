"""CPU memory: keep freed memory in the process, and back the big long-lived buffers with huge pages.

keep_freed_memory: so that per-step activation buffers don't page-fault every step.

glibc returns large blocks (>= its mmap threshold, which adapts up to 32 MiB) to the OS when they are
freed, and a step allocates tens of MiB of activations and gathered K/V per layer: every step then pays the
page faults again. vLLM's CPU backend recommends preloading tcmalloc for the same reason; raising glibc's
thresholds with mallopt gets most of the benefit with no preload.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import sys
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
_TRIM_THRESHOLD = 1 << 30
_configured = False


@functools.lru_cache(maxsize=None)
def libc() -> ctypes.CDLL:
    """The C library, loaded once (errno kept for ctypes.get_errno). OSError where there is none."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def mem_available() -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process. Returns whether it took effect."""
    global _configured
    if _configured or not sys.platform.startswith("linux"):
        return _configured
    try:
        ok = libc().mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        ok = libc().mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    _configured = ok
    if ok:
        logger.debug("glibc malloc: mmap threshold 32 MiB, trim threshold 1 GiB")
    return ok


def huge_page_zeros(num_bytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of `num_bytes` in fresh anonymous memory that asks for transparent huge
    pages (madvise; this machine's THP mode is usually "madvise", so nothing gets them unasked). For the
    buffers every step streams through, the packed weights and the KV cache: with 4 KiB pages each step
    takes a TLB miss for every 4 KiB of weights and of every scattered KV tile. Pages are faulted in when first
    touched (the KV cache commits its own: executor/kv_commit.py)."""
    buffer = mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP off in this kernel: ordinary pages
            pass
    return torch.frombuffer(buffer, dtype=torch.uint8)[:num_bytes]


class HugePageArena:
    """Long-lived buffers cut from chunks of huge_page_zeros as they are asked for: many weights of a few MiB
    each (a model's quantized linears), none of which would get huge pages alone, streamed by every decode step.
    Each buffer starts 64-byte aligned; a chunk's unused tail is address space only."""

    def __init__(self, chunk_bytes: int = 64 << 20) -> None:
        self._chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, num_bytes: int) -> torch.Tensor:
        """A zeroed uint8 tensor of num_bytes."""
        size = -(-num_bytes // 64) * 64
        if self._chunk is None or self._used + size > self._chunk.numel():
            self._chunk, self._used = huge_page_zeros(max(size, self._chunk_bytes)), 0
        buffer = self._chunk[self._used:self._used + num_bytes]
        self._used += size
        return buffer
