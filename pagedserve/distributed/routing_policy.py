"""RoutingPolicy: where one request goes, given each replica's load and how much of its prefix each holds.

`prefix` (SGLang's cache-aware routing, llm-d's prefix scorer): the replica holding the longest run of the
request's blocks, unless its load exceeds the least-loaded replica's by more than `imbalance_threshold`;
with no match anywhere, or when imbalanced, power of two choices on load. `least-loaded`: power of two
choices alone. `round-robin`: each replica in turn, blind to both (the baseline a plain load balancer gives).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pagedserve.distributed.prefix_index import PrefixIndex

ROUTER_POLICIES = ("prefix", "least-loaded", "round-robin")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "prefix"
    """How the ingress picks a replica: prefix, least-loaded or round-robin."""
    imbalance_threshold: int = 8
    """With prefix routing, a request leaves the replica holding its prefix when that replica has more than
    this many requests in flight beyond the least-loaded one."""
    index_capacity: int = 1 << 17
    """Block hashes the router remembers (LRU) across all replicas."""

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.policy!r}")
        if self.imbalance_threshold < 0:
            raise ValueError(f"the router's imbalance threshold must be >= 0, got {self.imbalance_threshold}")
        if self.index_capacity < 1:
            raise ValueError(f"the router's index capacity must be >= 1, got {self.index_capacity}")


@dataclass
class RoutingPolicy:
    config: RouterConfig = field(default_factory=RouterConfig)
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.index = PrefixIndex(self.config.index_capacity)
        self._turn = itertools.count()

    def rank(self, replicas: Sequence[str], loads: dict[str, int], hashes: Sequence[bytes] = ()) -> list[str]:
        """The replicas in order of preference for one request (the first is the choice)."""
        if not replicas:
            return []
        replicas = sorted(replicas)
        if self.config.policy == "round-robin":
            first = next(self._turn) % len(replicas)
            return replicas[first:] + replicas[:first]
        chosen = self._two_choices(replicas, loads)
        if self.config.policy == "prefix" and hashes:
            chosen = self._by_prefix(replicas, loads, hashes) or chosen
        return [chosen] + sorted((r for r in replicas if r != chosen), key=lambda r: loads.get(r, 0))

    def routed(self, hashes: Sequence[bytes], replica: str) -> list[bytes]:
        """A request with these block hashes went to `replica`; the hashes it holds anew."""
        if hashes and self.config.policy == "prefix":
            return self.index.insert(hashes, replica)
        return []

    def forget(self, replica: str) -> None:
        self.index.drop_replica(replica)

    def forget_chain(self, hashes: Sequence[bytes], replica: str) -> None:
        self.index.remove(hashes, replica)

    def _by_prefix(self, replicas: list[str], loads: dict[str, int], hashes: Sequence[bytes]) -> Optional[str]:
        matched = self.index.match(hashes, replicas)
        longest = max(matched.values())
        if longest == 0:
            return None
        best = min((r for r in replicas if matched[r] == longest), key=lambda r: loads.get(r, 0))
        least = min(loads.get(r, 0) for r in replicas)
        if loads.get(best, 0) - least > self.config.imbalance_threshold:
            return None
        return best

    def _two_choices(self, replicas: list[str], loads: dict[str, int]) -> str:
        if len(replicas) == 1:
            return replicas[0]
        a, b = self.rng.sample(replicas, 2)
        return a if loads.get(a, 0) <= loads.get(b, 0) else b
