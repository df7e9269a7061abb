"""A step's LoRA mapping: which token rows run with which adapter slot. Built by the model runner, read by
every LinearLoRA through the forward context (absent when no row of the step has an adapter)."""

from __future__ import annotations


class LoRAMapping:
    """The step's rows with an adapter as runs of consecutive rows of one slot. The runner orders the batch
    by slot, so a slot has one run, or two when it has both decodes and prefills; base-model rows (slot -1)
    are in no run and no LoRA work touches them."""

    def __init__(self, row_slots: list[int]) -> None:
        groups: list[tuple[int, slice]] = []
        start = 0
        for row in range(1, len(row_slots) + 1):
            if row == len(row_slots) or row_slots[row] != row_slots[start]:
                if row_slots[start] >= 0:
                    groups.append((row_slots[start], slice(start, row)))
                start = row
        if not groups:
            raise ValueError("a LoRA mapping needs at least one row with an adapter slot")
        self.groups = tuple(groups)
        """(slot, rows) for each run, in row order."""

    @property
    def num_rows(self) -> int:
        return sum(rows.stop - rows.start for _, rows in self.groups)
