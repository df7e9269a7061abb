"""The model's resident LoRA slots: a LinearLoRA on every decoder linear, and which adapter load each slot
holds. The scheduler decides the assignment (SlotTable); `activate` makes the weights follow it."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from pagedserve.lora.adapter import LoRAAdapter
from pagedserve.lora.layers import LinearLoRA
from pagedserve.lora.targets import fused_linears


class ModelLoRASlots:
    """`num_slots` LoRA slots on every decoder linear of `model` (attached as Linear.lora), sized for
    `max_rank`; `activate` fills them from loaded adapters, `resident` says what each holds."""

    def __init__(self, model, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots = num_slots
        self.dtype, self.device = dtype, device
        self.resident: list[Optional[int]] = [None] * num_slots
        """The adapter load generation each slot's weights are, None for an empty slot."""
        self._layers: list[LinearLoRA] = []
        self._by_module: dict[tuple[int, str], LinearLoRA] = {}
        layout = fused_linears(model)
        for index, layer in enumerate(model.model.layers):
            for fused in layout:
                linear = layer.get_submodule(fused.attribute)
                lora = LinearLoRA(fused, num_slots, max_rank, dtype, device)
                linear.lora = lora  # the one hook into the model: Linear.forward adds the delta
                self._layers.append(lora)
                self._by_module.update({(index, s.module): lora for s in fused.slices})

    @property
    def num_bytes(self) -> int:
        return sum(lora.num_bytes for lora in self._layers)

    def activate(self, assignment: dict[int, int], adapter_of: Callable[[int], LoRAAdapter]) -> int:
        """Make every slot in `assignment` (generation -> slot) hold that adapter, copying those that do not
        yet; returns how many were copied."""
        changed = 0
        for generation, slot in assignment.items():
            if self.resident[slot] != generation:
                self._load(slot, adapter_of(generation))
                changed += 1
        return changed

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        per_linear: dict[int, dict] = {id(lora): {} for lora in self._layers}
        for (layer, module), (a, b) in adapter.weights.items():
            lora = self._by_module[layer, module]
            per_linear[id(lora)][module] = (a.to(self.device), b.to(self.device))
        for lora in self._layers:
            lora.set_slot(slot, adapter.rank, per_linear[id(lora)])
        self.resident[slot] = adapter.generation
