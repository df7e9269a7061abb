"""Which adapter each of the `max_loras` weight slots holds, as the scheduler sees it. Pure Python.

A running request holds its adapter's slot (`acquire` when it starts running, `release` when it is
preempted or finishes). A slot nobody holds keeps its adapter, so a later request for it costs no copy, but
it may be given to another adapter: an empty slot first, else the one released longest ago. The model
runner mirrors the assignment (ModelLoRASlots) and copies an adapter into a slot when a step first needs it.
"""

from __future__ import annotations

import itertools
from typing import Optional


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._generation: list[Optional[int]] = [None] * num_slots  # the adapter load each slot holds
        self._users = [0] * num_slots
        self._released_at = [0] * num_slots
        self._clock = itertools.count(1)

    def slot_of(self, generation: int) -> Optional[int]:
        try:
            return self._generation.index(generation)
        except ValueError:
            return None

    def can_acquire(self, generation: int) -> bool:
        """Whether a request of this adapter can start running now (its adapter has or can get a slot)."""
        return self.slot_of(generation) is not None or 0 in self._users

    def acquire(self, generation: int) -> int:
        """Hold the adapter's slot for one more running request (giving it a slot if it has none)."""
        slot = self.slot_of(generation)
        if slot is None:
            idle = [s for s in range(self.num_slots) if self._users[s] == 0]
            if not idle:
                raise RuntimeError("no free LoRA slot (check can_acquire first)")
            slot = min(idle, key=lambda s: (self._generation[s] is not None, self._released_at[s]))
            self._generation[slot] = generation
        self._users[slot] += 1
        return slot

    def release(self, generation: int) -> None:
        slot = self.slot_of(generation)
        if slot is None or self._users[slot] == 0:
            raise RuntimeError(f"LoRA load {generation} holds no slot")
        self._users[slot] -= 1
        if self._users[slot] == 0:
            self._released_at[slot] = next(self._clock)

    def forget(self, generation: int) -> None:
        """An unloaded adapter's idle slot becomes empty (it is the first to be reused)."""
        slot = self.slot_of(generation)
        if slot is not None and self._users[slot] == 0:
            self._generation[slot] = None

    def active(self) -> dict[int, int]:
        """generation -> slot for every adapter some running request holds."""
        return {g: s for s, g in enumerate(self._generation) if g is not None and self._users[s]}
