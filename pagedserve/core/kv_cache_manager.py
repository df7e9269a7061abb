"""Maps requests to KV-cache blocks: allocates as tokens arrive, frees the moment a request leaves."""

from __future__ import annotations

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns every request's block table (list of block ids, in token order)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of `request` after its computed ones.

        Returns False (and allocates nothing) when the pool has too few free blocks.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        missing = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(blocks)
        if missing <= 0:
            return True
        if missing > self.pool.num_free_blocks:
            return False
        blocks.extend(self.pool.allocate(missing))
        return True

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def free(self, request: Request) -> None:
        """Give back all of a request's blocks. Tail blocks go first so that, once prefix caching keeps
        freed contents, a prompt's leading blocks (the most shareable) are evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.release(blocks[::-1])

    def usage(self) -> float:
        return self.pool.usage()
