"""The pool of KV-cache blocks: reference counts and a free queue."""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Hands out fixed-size KV-cache blocks by id and takes them back.

    A block may be shared by several sequences; it returns to the free queue when its reference count drops
    to zero. The free queue is ordered (an OrderedDict used as an O(1) removable queue) so that blocks are
    reused least-recently-freed first, which is the eviction order prefix caching needs.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (least recently freed first), each with reference count 1."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks but only {len(self._free)} are free")
        block_ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """Add a reference to blocks already in use (another sequence reads them too)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                raise RuntimeError(f"block {block_id} is free and cannot be shared")
            self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks nobody uses go to the back of the free queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} released more often than it was taken")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None

    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks
