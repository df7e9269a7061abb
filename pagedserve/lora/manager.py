"""The adapters held in memory: loaded on first use (or by add), least recently used first out.

Identity: a loaded adapter is known by its name and by its lora_int_id, and each load gets a fresh
`generation` (a counter), which is what requests, slots and prefix-cache hashes refer to. An adapter that
any queued or running request uses (`in_use`, generations given by the caller) is never evicted or
removed, so a request's weights cannot change under it.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from typing import AbstractSet, Optional

import torch

from pagedserve.config import LoRAConfig
from pagedserve.lora.adapter import LoRAAdapter, load_adapter
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.targets import LoRAShapes

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapters in memory, at most `max_cpu_loras` of them while unused (see `get_or_load`)."""

    def __init__(self, config: LoRAConfig, shapes: LoRAShapes, dtype: torch.dtype) -> None:
        self.config = config
        self.shapes = shapes
        self.dtype = dtype
        self._by_name: "OrderedDict[str, LoRAAdapter]" = OrderedDict()  # least recently used first
        self._by_generation: dict[int, LoRAAdapter] = {}
        self._generations = itertools.count(1)

    @property
    def capacity(self) -> int:
        return self.config.cpu_capacity

    def get_or_load(self, lora_request: LoRARequest, in_use: AbstractSet[int], replace: bool = True) -> LoRAAdapter:
        """The loaded adapter `lora_request` names, loading it first when needed. ValueError when it cannot be
        served. A loaded adapter with the same name or the same id but not this request is replaced by the
        new load when `replace` and nothing in use holds it (a reload; it never serves the old weights), and
        is a ValueError otherwise.

        Loading evicts unused adapters beyond max_cpu_loras, least recently used first; adapters in `in_use`
        stay, so while more distinct adapters than that are queued or running, more are held."""
        adapter = self._by_name.get(lora_request.lora_name)
        if adapter is None or adapter.lora_request != lora_request:
            conflicts = self._conflicts(lora_request)
            self._check_replaceable(lora_request, conflicts, in_use, replace)
            adapter = load_adapter(lora_request, self.shapes, self.config.max_lora_rank, self.dtype,
                                   next(self._generations))
            for old in conflicts:
                self._drop(old)
            self._evict_for_one_more(in_use)
            self._by_generation[adapter.generation] = adapter
            self._by_name[adapter.name] = adapter
            logger.info("loaded %s: rank %d, %d modules, %.1f MiB", lora_request.describe(), adapter.rank,
                        len(adapter.weights), adapter.num_bytes / 2**20)
        self._by_name.move_to_end(adapter.name)
        return adapter

    def add(self, lora_request: LoRARequest, in_use: AbstractSet[int]) -> bool:
        """Load an adapter now; True when it was loaded, False when it already was. Its name or id belonging
        to another loaded adapter is a ValueError (remove that one first)."""
        if self.find(lora_request) is not None:
            self.get_or_load(lora_request, in_use)  # marks it recently used
            return False
        self.get_or_load(lora_request, in_use, replace=False)
        return True

    def remove(self, lora_int_id: int, in_use: AbstractSet[int]) -> Optional[LoRAAdapter]:
        """Forget the adapter with this id and return it; None when none is loaded. ValueError while requests
        use it (they would otherwise lose their weights half-way)."""
        adapter = next((a for a in self._by_name.values() if a.lora_request.lora_int_id == lora_int_id), None)
        if adapter is None:
            return None
        if adapter.generation in in_use:
            raise ValueError(f"{adapter.lora_request.describe()} is in use by queued or running requests; it can "
                             "be removed once they finish or are aborted")
        self._drop(adapter)
        return adapter

    def list(self) -> list[LoRARequest]:
        """The loaded adapters' requests, least recently used first."""
        return [a.lora_request for a in self._by_name.values()]

    def adapter(self, generation: int) -> LoRAAdapter:
        """The adapter of a load generation that a request holds (so it is still loaded)."""
        return self._by_generation[generation]

    def find(self, lora_request: LoRARequest) -> Optional[LoRAAdapter]:
        """The loaded adapter that is exactly `lora_request` (name, id and path), or None."""
        adapter = self._by_name.get(lora_request.lora_name)
        return adapter if adapter is not None and adapter.lora_request == lora_request else None

    def _conflicts(self, lora_request: LoRARequest) -> list[LoRAAdapter]:
        """Loaded adapters other than `lora_request` that have its name or its id."""
        return [a for a in self._by_name.values() if a.lora_request != lora_request and (
            a.name == lora_request.lora_name or a.lora_request.lora_int_id == lora_request.lora_int_id)]

    @staticmethod
    def _check_replaceable(lora_request: LoRARequest, conflicts: list[LoRAAdapter], in_use: AbstractSet[int],
                           replace: bool) -> None:
        busy = [a for a in conflicts if a.generation in in_use]
        if conflicts and (busy or not replace):
            other = (busy or conflicts)[0].lora_request
            why = ("queued or running requests use it" if busy
                   else "remove it first to load another under that name or id")
            raise ValueError(f"{lora_request.describe()} conflicts with the loaded {other.describe()}: a name and "
                             f"an id stand for one adapter, and {why}")

    def _evict_for_one_more(self, in_use: AbstractSet[int]) -> None:
        unused = [a for a in self._by_name.values() if a.generation not in in_use]
        excess = len(self._by_name) + 1 - self.capacity
        for adapter in unused[:max(excess, 0)]:
            logger.info("evicted %s (least recently used; max_cpu_loras=%d)", adapter.lora_request.describe(),
                        self.capacity)
            self._drop(adapter)

    def _drop(self, adapter: LoRAAdapter) -> None:
        del self._by_name[adapter.name]
        del self._by_generation[adapter.generation]
