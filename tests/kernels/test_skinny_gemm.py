"""The small-batch bf16 matmul equals torch's linear (to bf16 rounding), and layers use it only where it pays.
Each kernel test runs at every ISA level this CPU can run (the `isa` fixture, tests/kernels/conftest.py)."""

import pytest
import torch

from pagedserve.kernels import skinny_gemm
from pagedserve.layers.linear import Linear

FP32_FMA_LEVELS = ("avx2", "avx512")  # the AVX2 path: bf16 widened to fp32, one FMA per k


def packed_or_skip(weight: torch.Tensor, isa: str) -> skinny_gemm.PackedWeight:
    packed = skinny_gemm.PackedWeight.of(weight)
    if packed is None:
        pytest.skip("skinny_gemm has no generic path: layers use torch" if isa == "generic" else "no C compiler")
    return packed


# From 24 rows (2 passes of 12) the AVX-512 BF16 path reads full passes from rows regrouped in panels: 24, 36 and
# 75 (6 panels and 3 rows as they are) take it.
@pytest.mark.parametrize("rows", [1, 7, 12, 13, 16, 17, 24, 32, 36, 75])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch_linear(isa, rows, bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 160, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 160, generator=g).bfloat16()
    out = skinny_gemm.linear(x, packed_or_skip(weight, isa), b)
    exact = x.float() @ weight.float().t() + (b.float() if bias else 0)
    expected = torch.nn.functional.linear(x, weight, b)
    # Both sum the same products in float32 and round once; only the order of the sums may differ.
    assert torch.allclose(out.float(), exact, rtol=1e-2, atol=1e-2)
    assert (out == expected).float().mean() > 0.99


@pytest.mark.parametrize("bias", [False, True])
def test_fp32_path_sums_in_k_order_and_rounds_to_nearest_even(isa, bias):
    if isa not in FP32_FMA_LEVELS:
        pytest.skip(f"{isa}: AVX-512 BF16 dot products add k pairs first" if isa == "avx512_bf16"
                    else "skinny_gemm has no generic path")
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(48, 96, generator=g).bfloat16()
    x = torch.randn(9, 96, generator=g).bfloat16()
    x[0, :3] = torch.tensor([1e38, 1e38, 1e38])  # one of row 0's sums overflows to inf, as in float32
    b = torch.randn(48, generator=g).bfloat16() if bias else None
    out = skinny_gemm.linear(x, packed_or_skip(weight, isa), b)
    acc = torch.zeros(9, 48)
    for k in range(96):  # bf16 x bf16 products are exact in float32, so an FMA equals multiply-then-add
        acc = acc + x[:, k:k + 1].float() * weight[:, k].float()
    assert torch.equal(out, (acc + (b.float() if bias else 0)).bfloat16())


@pytest.mark.parametrize("rows", [1, 5, 16, 32])
def test_accumulate_adds_into_out_before_the_one_rounding(isa, rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 96, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    packed = packed_or_skip(weight, isa)
    zeros = torch.zeros(rows, 48, dtype=torch.bfloat16)
    skinny_gemm.linear_accumulate(x, packed, zeros)
    assert torch.equal(zeros, skinny_gemm.linear(x, packed))  # into zeros: exactly the plain product
    out = torch.randn(rows, 48, generator=g).bfloat16()
    got = out.clone()
    skinny_gemm.linear_accumulate(x, packed, got)
    if isa in FP32_FMA_LEVELS:  # sums in k order, then out, rounded once
        acc = torch.zeros(rows, 48)
        for k in range(96):
            acc = acc + x[:, k:k + 1].float() * weight[:, k].float()
        assert torch.equal(got, (acc + out.float()).bfloat16())
    else:
        exact = out.float() + x.float() @ weight.float().t()
        assert torch.allclose(got.float(), exact, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="contiguous bf16"):
        skinny_gemm.linear_accumulate(x, packed, torch.zeros(rows, 48))  # float32


def test_each_row_is_independent_of_the_others(isa):
    g = torch.Generator().manual_seed(0)
    packed = packed_or_skip(torch.randn(64, 128, generator=g).bfloat16(), isa)
    x = torch.randn(40, 128, generator=g).bfloat16()  # 3 passes from panels, 4 rows as they are
    together = skinny_gemm.linear(x, packed)
    alone = torch.cat([skinny_gemm.linear(x[i:i + 1], packed) for i in range(40)])
    assert torch.equal(together, alone)


def test_weights_the_kernel_cannot_take_are_not_packed(isa):
    assert skinny_gemm.PackedWeight.of(torch.zeros(32, 8)) is None  # float32
    assert skinny_gemm.PackedWeight.of(torch.zeros(24, 8, dtype=torch.bfloat16)) is None  # 24 % 16 != 0
    if isa == "generic":  # no path: the layers keep torch
        assert skinny_gemm.PackedWeight.of(torch.zeros(16, 2, dtype=torch.bfloat16)) is None
        assert not Linear(64, 48).bfloat16().pack_for_small_batches()


def test_linear_layer_uses_the_packed_copy_only_for_small_batches_where_torch_is_faster_above(isa):
    layer = Linear(64, 48, bias=True).bfloat16()
    weight = layer.weight.detach().clone()
    if not layer.pack_for_small_batches():
        packed_or_skip(layer.weight, isa)
    small = torch.randn(skinny_gemm.MAX_ROWS, 64).bfloat16()
    large = torch.randn(skinny_gemm.MAX_ROWS + 1, 64).bfloat16()
    expected_large = skinny_gemm.linear(large, layer.packed, layer.bias)
    layer.packed = skinny_gemm.PackedWeight(torch.zeros_like(layer.packed.data), 48, 64)  # a visibly wrong copy
    assert torch.equal(layer(small), layer.bias.expand(skinny_gemm.MAX_ROWS, 48))  # bias only: packed path
    if skinny_gemm.takes_every_batch():  # AVX-512 BF16: the packed copy is the only one, for every batch
        assert layer.held_packed_only and layer.weight.numel() == 0
        assert torch.equal(layer(large), layer.bias.expand(skinny_gemm.MAX_ROWS + 1, 48))
        assert not torch.equal(expected_large, layer(large))
    else:  # torch above MAX_ROWS, on the plain weight kept beside the packed copy
        assert not layer.held_packed_only
        assert torch.equal(layer(large), torch.nn.functional.linear(large, weight, layer.bias))


def test_a_layer_held_packed_only_gives_every_batch_size_the_plain_weights_result(isa):
    layer = Linear(64, 80, bias=False).bfloat16()
    weight = layer.weight.detach().clone()
    if not layer.pack_for_small_batches() or not layer.held_packed_only:
        pytest.skip(f"{isa}: the packed kernel does not take every batch here (layers keep the plain weight)")
    x = torch.randn(3, 50, 64).bfloat16()  # 150 rows, in a 3-d batch
    out = layer(x)
    assert out.shape == (3, 50, 80)
    assert (out == torch.nn.functional.linear(x, weight)).float().mean() > 0.99  # rounding order only
    assert torch.equal(out[1, 7], layer(x[1, 7:8])[0])  # a row's result does not depend on the batch


def test_rows_of_a_packed_table_are_its_rows_exactly(isa):
    """A tied LM head held only packed still serves the token embeddings: each looked-up row is the bf16 row."""
    table = torch.randn(48, 64).bfloat16()
    packed = packed_or_skip(table, isa)
    ids = torch.tensor([[0, 47, 16], [15, 16, 3]])
    assert torch.equal(skinny_gemm.rows(ids, packed), table[ids])
    for bad in (48, -1):
        with pytest.raises(IndexError, match="ids must lie in 0..47"):
            skinny_gemm.rows(torch.tensor([2, bad]), packed)


@pytest.mark.parametrize("rows", [1, 11, 12, 13, 40, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_ending_in_swiglu_gives_the_bits_of_the_matmul_then_swiglu(isa, rows, bias):
    from pagedserve.kernels import fused_ops

    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(2 * 48, 160, generator=g).bfloat16()  # gate rows, then up rows
    b = torch.randn(2 * 48, generator=g).bfloat16() if bias else None
    x = (4 * torch.randn(rows, 160, generator=g)).bfloat16()  # gates well into both tails of silu
    packed = packed_or_skip(weight, isa)
    if not skinny_gemm.fuses_swiglu(packed):
        pytest.skip(f"{isa}: the SwiGLU epilogue is on the AVX-512 BF16 layout only (layers fall back to matmul "
                    "then SwiGLU)")
    fused = skinny_gemm.linear_swiglu(x, packed, b)
    assert torch.equal(fused, fused_ops.swiglu(skinny_gemm.linear(x, packed, b)))
    gate, up = torch.nn.functional.linear(x.float(), weight.float(), b.float() if bias else None).chunk(2, dim=-1)
    assert torch.allclose(fused.float(), torch.nn.functional.silu(gate) * up, rtol=3e-2, atol=3e-2)


def test_swiglu_epilogue_refuses_halves_that_are_not_whole_column_blocks(isa):
    packed = packed_or_skip(torch.randn(48, 64).bfloat16(), isa)  # halves of 24 columns
    assert not skinny_gemm.fuses_swiglu(packed)


@pytest.mark.parametrize("rows", [3, 40, 300])
def test_gate_up_layer_gives_silu_and_mul_of_its_output_bit_for_bit(isa, rows):
    from pagedserve.layers.activation import silu_and_mul

    layer = Linear(96, 2 * 64, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 96).bfloat16()
    assert torch.equal(layer.forward_swiglu(x), silu_and_mul(layer(x)))  # plain weight: torch, then SwiGLU
    layer.pack_for_small_batches()  # where the kernel builds: packed (only, on avx512_bf16), maybe fused
    assert torch.equal(layer.forward_swiglu(x), silu_and_mul(layer(x)))


def _never_measured():
    raise AssertionError("measured where no measurement was due")


def test_large_batch_choice_that_is_not_one_of_the_choices_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match="PAGEDSERVE_BF16_LARGE_BATCH='fast' is not one of auto, packed, torch"):
        skinny_gemm.large_batches_packed("fast", ["avx512_bf16"], _never_measured)


def test_auto_keeps_every_batch_on_the_packed_kernel_without_amx_and_measures_nothing():
    assert skinny_gemm.large_batches_packed("auto", ["avx512f", "avx512_bf16"], _never_measured)


@pytest.mark.parametrize("choice, flags, packed", [("packed", ["amx_bf16"], True), ("torch", ["avx512_bf16"], False)])
def test_a_forced_choice_holds_on_any_cpu_without_measuring(choice, flags, packed):
    assert skinny_gemm.large_batches_packed(choice, flags, _never_measured) is packed


@pytest.mark.parametrize("packed_s, torch_s, packed", [(2.0e-3, 1.0e-3, False), (1.2e-3, 1.0e-3, True),
                                                       (0.9e-3, 1.0e-3, True)])
def test_auto_on_amx_gives_large_batches_to_torch_only_when_it_measures_faster_by_the_margin(packed_s, torch_s,
                                                                                             packed, caplog):
    caplog.set_level("INFO", logger="pagedserve.kernels.skinny_gemm")
    assert skinny_gemm.large_batches_packed("auto", ["amx_bf16", "avx512_bf16"],
                                            lambda: (packed_s, torch_s)) is packed
    assert f"packed kernel {packed_s * 1e3:.2f} ms, torch (oneDNN) {torch_s * 1e3:.2f} ms" in caplog.text


def test_the_load_time_measurement_times_both_paths_on_this_cpu(isa):
    if isa != "avx512_bf16":
        pytest.skip(f"{isa}: the measurement is only made at the avx512_bf16 level (AMX CPUs take it)")
    packed_or_skip(torch.zeros(16, 16).bfloat16(), isa)
    packed_s, torch_s = skinny_gemm.measure_large_batch(repeats=1)
    assert 0 < packed_s < 1 and 0 < torch_s < 1


def test_large_batches_forced_to_torch_keep_the_plain_weight_and_the_packed_copy_for_small_ones(isa, monkeypatch):
    if isa != "avx512_bf16":
        pytest.skip(f"{isa}: only the avx512_bf16 level's packed kernel can take every batch")
    monkeypatch.setenv(skinny_gemm.LARGE_BATCH_ENV, "torch")
    layer = Linear(64, 48, bias=False).bfloat16()
    weight = layer.weight.detach().clone()
    if not layer.pack_for_small_batches():
        packed_or_skip(weight, isa)
    assert not skinny_gemm.takes_every_batch() and not layer.held_packed_only
    large = torch.randn(skinny_gemm.MAX_ROWS + 1, 64).bfloat16()
    assert torch.equal(layer(large), torch.nn.functional.linear(large, weight))
    small = torch.randn(4, 64).bfloat16()
    assert torch.equal(layer(small), skinny_gemm.linear(small, layer.packed))
