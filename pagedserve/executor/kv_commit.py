"""Committing the CPU KV cache's memory block by block, in the order the block pool hands blocks out.

The cache is fresh anonymous memory (cpu_allocator.huge_page_zeros) whose pages are committed with
MADV_POPULATE_WRITE so that a server's memory is what it will be under load. On some VMs committing fresh
memory is slow: 0.3-2.4 s per GiB on the project's VMs, so up to 9 s for the default 4 GiB cache, most
of a server's start-up. Committing it in the background instead, beside the model load, gains nothing there
(the load's own page faults wait for the commit; measured: load 2.7 s -> 8-11 s). So the engine commits the
first blocks before it reports ready and the rest while it is idle (`EngineCore.commit_kv_memory`).

A fresh block pool hands out blocks in id order, so the blocks committed first are the ones used first; a
block the commit has not reached yet when a step writes it has its pages faulted in then (zero-filled, as
committed pages are): only slower, never different.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os

import torch

from pagedserve.executor.cpu_allocator import libc, mem_available

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+; Python 3.11's mmap lacks it


def _madvise_populate(address: int, length: int) -> int:
    """MADV_POPULATE_WRITE over [address, address + length), widened to whole pages; 0 or the errno."""
    start = address - address % mmap.PAGESIZE
    end = -(-(address + length) // mmap.PAGESIZE) * mmap.PAGESIZE
    if libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_POPULATE_WRITE):
        return ctypes.get_errno()
    return 0


UNIT_BYTES = 2 << 20
"""About what one madvise call commits (one transparent huge page of one tensor): the unit of work, so that a
caller committing a little at a time (the idle engine core) is never held up long by one call."""


class KVCommitter:
    """Commits the pages of cache tensors whose first dimension is the block id, in block order: a range of
    blocks of one tensor at a time (a unit of about UNIT_BYTES), that range in every tensor before the next."""

    def __init__(self, tensors: list[torch.Tensor], num_blocks: int) -> None:
        for tensor in tensors:
            if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.shape[0] != num_blocks:
                raise ValueError("KVCommitter needs contiguous CPU tensors of num_blocks rows")
        self._rows = [(t.data_ptr(), t.numel() * t.element_size() // num_blocks) for t in tensors]
        self.num_blocks = num_blocks
        self.bytes_per_block = sum(row_bytes for _, row_bytes in self._rows)
        self._blocks_per_unit = max(1, UNIT_BYTES // max((row for _, row in self._rows), default=1))
        self.committed_blocks = 0
        """Blocks committed in every tensor."""
        self._next_tensor = 0  # the next unit: this tensor's range from committed_blocks

    @property
    def done(self) -> bool:
        return self.committed_blocks >= self.num_blocks

    @property
    def committed_bytes(self) -> int:
        return self.committed_blocks * self.bytes_per_block

    def commit_bytes(self, num_bytes: int) -> int:
        """Commit the next units until num_bytes are committed (or all is); returns the bytes committed.
        MemoryError when the machine has not the memory."""
        committed = 0
        while committed < num_bytes and not self.done:
            end = min(self.committed_blocks + self._blocks_per_unit, self.num_blocks)
            address, row_bytes = self._rows[self._next_tensor]
            length = (end - self.committed_blocks) * row_bytes
            if not self._populate(address + self.committed_blocks * row_bytes, length):
                self.committed_blocks = self.num_blocks  # nothing can be committed: all is left to fault in
                break
            committed += length
            self._next_tensor += 1
            if self._next_tensor == len(self._rows):
                self._next_tensor, self.committed_blocks = 0, end
        return committed

    def commit_all(self) -> int:
        """Commit what is left; returns the bytes committed."""
        return self.commit_bytes(self.num_blocks * self.bytes_per_block)

    def check_rest_fits(self) -> None:
        """MemoryError now, naming the fix, when what is left to commit is more than the machine has available:
        a cache committed later must fail at start-up, as one committed at once does."""
        rest = (self.num_blocks - self.committed_blocks) * self.bytes_per_block
        available = mem_available()
        if available is not None and rest > available:
            raise MemoryError(f"the KV cache needs {rest / 2**30:.2f} GiB more than is committed, but only "
                              f"{available / 2**30:.2f} GiB is available (lower --kv-cache-memory-bytes)")

    def _populate(self, address: int, length: int) -> bool:
        """Whether the range was committed (False: this kernel cannot commit ahead)."""
        error = _madvise_populate(address, length)
        if error == errno.ENOMEM:
            size = self.num_blocks * self.bytes_per_block / 2**30
            raise MemoryError(f"cannot commit the KV cache's memory ({size:.2f} GiB): not enough memory "
                              "(lower --kv-cache-memory-bytes)")
        if error:  # EINVAL: a kernel before 5.14; every page faults in when first written instead
            logger.debug("MADV_POPULATE_WRITE failed (%s): the KV cache's pages fault in as they are used",
                         os.strerror(error))
            return False
        return True
