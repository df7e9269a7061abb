"""LinearLoRA: each run of rows gets exactly its slot's adapter's x @ A.T @ B.T in the right output slices
(fused q/k/v each with their own A and B), ranks below the slot rank are exact, base rows are untouched."""

from __future__ import annotations

import pytest
import torch

from pagedserve.lora.layers import LinearLoRA
from pagedserve.lora.mapping import LoRAMapping
from pagedserve.lora.targets import FusedLinear, OutputSlice

QKV = FusedLinear("self_attn.qkv_proj", 32, 64,
                  (OutputSlice("q_proj", 0, 32), OutputSlice("k_proj", 32, 16), OutputSlice("v_proj", 48, 16)))
CPU = torch.device("cpu")


def random_module(rank: int, size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rank, 32, generator=generator), torch.randn(size, rank, generator=generator)


def reference(x: torch.Tensor, modules: dict) -> torch.Tensor:
    """One adapter's delta on one row: each module's x @ A.T @ B.T in its slice, zeros elsewhere."""
    out = torch.zeros(QKV.out_features)
    for s in QKV.slices:
        if s.module in modules:
            a, b = modules[s.module]
            out[s.offset:s.offset + s.size] = x @ a.T @ b.T
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_get_their_slots_delta_in_their_slices_and_base_rows_nothing(dtype, isa):
    # `isa`: once per kernel level this CPU runs (bf16 slots pack for the small-batch kernel of that level).
    lora = LinearLoRA(QKV, num_slots=3, max_rank=24, dtype=dtype, device=CPU)
    adapters = {0: (20, {"q_proj": random_module(20, 32, 1), "v_proj": random_module(20, 16, 2)}),
                2: (3, {"k_proj": random_module(3, 16, 3), "q_proj": random_module(3, 32, 4)})}
    for slot, (rank, modules) in adapters.items():
        lora.set_slot(slot, rank, {m: (a.to(dtype), b.to(dtype)) for m, (a, b) in modules.items()})
    x = torch.randn(7, 32).to(dtype)
    base = torch.randn(7, 64).to(dtype)
    out = base.clone()
    row_slots = [-1, 0, 0, 2, -1, 2, 0]
    lora.add_delta(x, out, LoRAMapping(row_slots))
    tolerance = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.5, rtol=0.02)
    for row, slot in enumerate(row_slots):
        if slot < 0:
            assert torch.equal(out[row], base[row])
            continue
        modules = {m: (a.to(dtype).float(), b.to(dtype).float()) for m, (a, b) in adapters[slot][1].items()}
        expected = base[row].float() + reference(x[row].float(), modules)
        assert torch.allclose(out[row].float(), expected, **tolerance)


def test_a_slot_whose_adapter_leaves_the_linear_alone_or_that_was_cleared_adds_nothing():
    lora = LinearLoRA(QKV, num_slots=2, max_rank=4, dtype=torch.float32, device=CPU)
    lora.set_slot(0, 4, {"q_proj": random_module(4, 32, 0)})
    lora.set_slot(0, 4, {})
    lora.set_slot(1, 4, {})
    out = torch.zeros(2, 64)
    lora.add_delta(torch.randn(2, 32), out, LoRAMapping([0, 1]))
    assert not out.any() and lora.widths == [0, 0]


def test_the_mapping_groups_rows_into_runs_of_one_slot():
    assert LoRAMapping([-1, 1, 1, 0, -1, 0]).groups == ((1, slice(1, 3)), (0, slice(3, 4)), (0, slice(5, 6)))
    with pytest.raises(ValueError):
        LoRAMapping([-1, -1])
