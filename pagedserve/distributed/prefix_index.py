"""PrefixIndex: which replica was sent which block-hash chain, as the router remembers it.

The hashes are the engine's own (`core.kv_cache_manager.hash_block`: chained, salted per tenant), so a chain
known for a replica is a prefix that replica has computed, unless its cache has evicted it since: the index
is approximate, and bounded (least recently used hashes are forgotten first).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from pagedserve.core.kv_cache_manager import hash_block


def routing_hashes(token_ids: Sequence[int], block_size: int, cache_salt: Optional[str],
                   lora_name: Optional[str] = None) -> list[bytes]:
    """The hashes of a prompt's full blocks, as the engine computes them. An adapter enters as its name alone
    (the ingress does not know the engine's load generation): one adapter, one routing identity."""
    hashes: list[bytes] = []
    lora = None if lora_name is None else (lora_name, 0)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, list(token_ids[start:start + block_size]),
                                 cache_salt, lora))
    return hashes


class PrefixIndex:
    def __init__(self, capacity: int = 1 << 17) -> None:
        if capacity < 1:
            raise ValueError(f"the prefix index needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def insert(self, hashes: Sequence[bytes], replica: str) -> list[bytes]:
        """Remember that `replica` now holds the chain `hashes`; returns the hashes it did not hold before."""
        added = []
        # Last block first, so that a chain's head is the most recently used: LRU forgets tails before heads,
        # and a remembered run always starts at the first block.
        for h in reversed(hashes):
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = set()
            else:
                self._holders.move_to_end(h)
            if replica not in holders:
                holders.add(replica)
                added.append(h)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)
        return added

    def match(self, hashes: Sequence[bytes], replicas: Iterable[str]) -> dict[str, int]:
        """For each replica, how many leading blocks of `hashes` it holds."""
        remaining = set(replicas)
        matched = dict.fromkeys(remaining, 0)
        for n, h in enumerate(hashes):
            holders = self._holders.get(h)
            if holders is None:
                break
            remaining &= holders
            if not remaining:
                break
            for r in remaining:
                matched[r] = n + 1
        return matched

    def remove(self, hashes: Sequence[bytes], replica: str) -> None:
        """Forget that `replica` holds the chain `hashes` (it was remembered too early)."""
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del self._holders[h]

    def replicas(self) -> set[str]:
        """Every replica that holds some chain."""
        return set().union(*self._holders.values()) if self._holders else set()

    def drop_replica(self, replica: str) -> None:
        """Forget everything a replica held (it died: its cache went with it)."""
        empty = []
        for h, holders in self._holders.items():
            holders.discard(replica)
            if not holders:
                empty.append(h)
        for h in empty:
            del self._holders[h]
