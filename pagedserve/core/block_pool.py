"""The pool of KV-cache blocks: reference counts, a free queue, and the hash -> block map of cached blocks."""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional


class BlockPool:
    """Hands out fixed-size KV-cache blocks by id and takes them back.

    A block may be shared by several sequences; it returns to the free queue when its reference count drops
    to zero. A full block can carry a hash of its contents (see kv_cache_manager.hash_block): a freed block
    keeps its contents and hash, so a later request with the same prefix can take it back from the free
    queue (`touch`) instead of recomputing it. The free queue is ordered (an OrderedDict used as an O(1)
    removable queue): allocation takes the least recently freed block first and evicts its hash, so cached
    blocks are reused least-recently-used first, and a block in use is never evicted.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[Optional[bytes]] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (least recently freed first, evicting their cached contents), each with
        reference count 1."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks but only {len(self._free)} are free")
        block_ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """Add a reference to blocks already in use (another sequence reads them too)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                raise RuntimeError(f"block {block_id} is free and cannot be shared")
            self.ref_counts[block_id] += 1

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks, whether in use or sitting in the free queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks nobody uses go to the back of the free queue (their
        cached contents stay until the block is allocated again)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} released more often than it was taken")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None

    def get_cached_block(self, block_hash: bytes) -> Optional[int]:
        return self.cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Record that `block_id` (full, in use) holds the contents `block_hash` names. If another block
        already holds the same contents, that one stays the cached copy."""
        if self.block_hashes[block_id] is None and block_hash not in self.cached:
            self.block_hashes[block_id] = block_hash
            self.cached[block_hash] = block_id

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hashes[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block's contents (so no later request reuses them). Only when no block is in
        use, as in vLLM: returns False and changes nothing otherwise."""
        if len(self._free) != self.num_blocks:
            return False
        self.cached.clear()
        self.block_hashes = [None] * self.num_blocks
        return True

    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks
