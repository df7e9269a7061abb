"""One linear's LoRA slots and the per-row delta it adds to the base output.

Layout: slot s holds A as a[s] [width, in] and B transposed as bt[s] [width, out] (both preallocated for the
largest rank, zero-padded). The adapter's modules fused into this linear (q, k, v of qkv_proj; gate, up of
gate_up_proj) sit side by side in the width, each a rank-sized block, and B is block-diagonal: each keeps its
own A and B, and its delta lands in its own output slice. A slot uses only the first `widths[s]` rows: its
adapter's rank (rounded up to RANK_ALIGN) times the number of slices, 0 when the adapter leaves this linear
alone (then the slot costs nothing here).

The delta, per run of rows of one slot (LoRAMapping.groups): out[rows] += (x[rows] @ a[s].T) @ bt[s], with the
small-batch kernel on CPU bf16 (the expand adds into out before its one rounding). For that kernel each slot
also has A and B packed, at fixed addresses for the life of the slots (`packed_a`, `packed_b`, `slot_widths`),
so that the C decode loop (kernels/decode_layers.py) can apply the same deltas with the same kernels. Grouping rows by slot beat computing every slot for every row and masking
(2 matmuls per linear whatever the number of adapters): at 16 decode rows with 4 adapters on the default
model, 40.8 vs 44.4 ms a step (1 adapter: 38.6 vs 41.4), because each row only multiplies its own adapter.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedserve.kernels import skinny_gemm
from pagedserve.lora.mapping import LoRAMapping
from pagedserve.lora.targets import FusedLinear

RANK_ALIGN = 16
"""Slot ranks are rounded up to this, so that the slot weights fit the small-batch kernel's layout."""


def aligned_rank(rank: int) -> int:
    return -(-rank // RANK_ALIGN) * RANK_ALIGN


class LinearLoRA:
    """The LoRA weights of every slot for one linear, and the delta they add."""

    def __init__(self, linear: FusedLinear, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.slices = {s.module: (index, s) for index, s in enumerate(linear.slices)}
        max_width = len(linear.slices) * aligned_rank(max_rank)
        self.a = torch.zeros(num_slots, max_width, linear.in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(num_slots, max_width, linear.out_features, dtype=dtype, device=device)
        self.widths = [0] * num_slots
        self.slot_widths = torch.zeros(num_slots, dtype=torch.int64)
        """`widths` as a tensor, for C callers."""
        self.packed_a: Optional[torch.Tensor] = None
        """[num_slots, max_width * in]: each slot's A packed for the small-batch kernel (None where it cannot
        run); packed_b [num_slots, out * max_width] likewise B (as a [out, width] weight)."""
        self.packed_b: Optional[torch.Tensor] = None
        if (skinny_gemm.PackedWeight.packed_shape(self.a[0]) is not None
                and skinny_gemm.PackedWeight.packed_shape(self.bt[0].T) is not None):
            self.packed_a = torch.empty(num_slots, self.a[0].numel(), dtype=dtype)
            self.packed_b = torch.empty(num_slots, self.bt[0].numel(), dtype=dtype)
        self._packed: list[Optional[tuple[skinny_gemm.PackedWeight, skinny_gemm.PackedWeight]]] = [None] * num_slots

    @property
    def num_bytes(self) -> int:
        return self.a.nbytes + self.bt.nbytes

    def set_slot(self, slot: int, rank: int, modules: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make the slot one adapter's: `modules` maps this linear's module names to (A [r, in], B [size, r]),
        already scaled; modules left out (and ranks below `rank`) are zeros. An empty dict clears the slot."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        block = aligned_rank(rank)
        for module, (a, b) in modules.items():
            index, out = self.slices[module]
            start = index * block
            self.a[slot, start:start + a.shape[0]].copy_(a)
            self.bt[slot, start:start + a.shape[0], out.offset:out.offset + out.size].copy_(b.T)
        self.widths[slot] = len(self.slices) * block if modules else 0
        self.slot_widths[slot] = self.widths[slot]
        self._packed[slot] = self._pack(slot) if modules else None

    def _pack(self, slot: int):
        """The slot's A and B laid out for the small-batch kernel (CPU bf16), or None where it cannot run."""
        if self.packed_a is None:
            return None
        width = self.widths[slot]
        a, b = self.a[slot, :width], self.bt[slot, :width].T
        packed_a = skinny_gemm.PackedWeight.of(a, self.packed_a[slot, :a.numel()])
        packed_b = skinny_gemm.PackedWeight.of(b, self.packed_b[slot, :b.numel()])
        return None if packed_a is None or packed_b is None else (packed_a, packed_b)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, mapping: LoRAMapping) -> None:
        """out[rows] += each row's adapter delta, in place, for the mapping's rows only."""
        for slot, rows in mapping.groups:
            width = self.widths[slot]
            if not width:
                continue
            packed = self._packed[slot]
            if packed is not None and rows.stop - rows.start <= skinny_gemm.MAX_ROWS:
                skinny_gemm.linear_accumulate(skinny_gemm.linear(x[rows], packed[0]), packed[1], out[rows])
            else:
                out[rows].addmm_(F.linear(x[rows], self.a[slot, :width]), self.bt[slot, :width])
