"""Maps requests to KV-cache blocks: allocates as tokens arrive, frees the moment a request leaves, and
(with prefix caching) finds the leading blocks of a new request that are already in the pool."""

from __future__ import annotations

import hashlib
from array import array
from typing import Optional

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent_hash: Optional[bytes], token_ids: list[int], cache_salt: Optional[str],
               lora: Optional[tuple[str, int]] = None) -> bytes:
    """The identity of a full block: its tokens, chained over the previous block's hash so that equal
    tokens after different prefixes never collide. The request's cache salt (one per tenant) and its LoRA
    adapter (name, load generation) enter the first block, so they change the whole chain: two adapters, an
    adapter and the base model, or two loads of one adapter never share KV. SHA-256, not Python's hash: a
    tenant must not be able to craft a collision with another tenant's blocks."""
    h = hashlib.sha256(parent_hash or b"")
    if parent_hash is None and lora is not None:
        # Length-prefixed and ahead of the salt, so that no salt can spell out an adapter's identity.
        name = lora[0].encode()
        h.update(b"lora:%d:%s:%d;" % (len(name), name, lora[1]))
    if parent_hash is None and cache_salt is not None:
        h.update(b"salt:" + cache_salt.encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def _lora_identity(request: Request) -> Optional[tuple[str, int]]:
    if request.lora_generation is None:
        return None
    return request.lora_request.lora_name, request.lora_generation


class KVCacheManager:
    """Owns every request's block table (list of block ids, in token order) and its block hashes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}
        self.req_to_hashes: dict[str, list[bytes]] = {}
        self.req_num_cached_blocks: dict[str, int] = {}  # blocks already offered to the cache, per request
        # Prefix-cache counters, in tokens (exported as pagedserve:prefix_cache_queries/hits_total).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix caching ----------------------------------------------------------------------------------

    def _block_hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the request's full blocks within its first `num_tokens` tokens (computed once each)."""
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        size = self.block_size
        lora = _lora_identity(request)
        for i in range(len(hashes), num_tokens // size):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, request.all_token_ids[i * size:(i + 1) * size], request.cache_salt,
                                     lora))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The leading full blocks of a request (with no KV yet) that the pool already holds. The last token
        is never taken from the cache: its logits are needed, so it must be computed."""
        if not self.enable_prefix_caching:
            return []
        hashes = self._block_hashes(request, request.num_tokens - 1)
        blocks = []
        for block_hash in hashes:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def record_prefix_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count a lookup whose blocks were taken (a lookup retried next step is counted once)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_cached_tokens

    def cache_blocks(self, request: Request) -> None:
        """Record the hashes of the request's blocks that are full of computed tokens, so that later
        requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id, [])
        hashes = self._block_hashes(request, request.num_computed_tokens)
        start = self.req_num_cached_blocks.get(request.request_id, 0)
        for index in range(start, min(len(blocks), len(hashes))):
            self.pool.cache_block(blocks[index], hashes[index])
        self.req_num_cached_blocks[request.request_id] = max(start, min(len(blocks), len(hashes)))

    # -- allocation --------------------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Optional[list[int]] = None) -> bool:
        """Make room for `num_new_tokens` more tokens of `request` after its computed ones; `computed_blocks`
        (from get_computed_blocks, for a request that has no blocks yet) become its first blocks.

        Returns False (and changes nothing) when the pool has too few free blocks.
        """
        computed_blocks = computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        missing = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(blocks) - len(computed_blocks)
        # Cached blocks that sit in the free queue stop being free once taken.
        free = self.pool.num_free_blocks - sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        if missing > free:
            return False
        blocks = self.req_to_blocks.setdefault(request.request_id, blocks)
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
        if missing > 0:
            blocks.extend(self.pool.allocate(missing))
        return True

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def free(self, request: Request, keep_hashes: bool = False) -> None:
        """Give back all of a request's blocks. Tail blocks go first so that a prompt's leading blocks (the
        most shareable) are evicted last. A preempted request keeps its hashes (its tokens are unchanged)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.req_num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.release(blocks[::-1])
        if not keep_hashes:
            self.req_to_hashes.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        """See BlockPool.reset_prefix_cache."""
        return self.pool.reset_prefix_cache()

    def usage(self) -> float:
        return self.pool.usage()
