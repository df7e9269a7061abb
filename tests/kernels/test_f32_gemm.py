"""The packed float32 matmul (AVX2-only CPUs) equals torch's linear to float32 rounding, gives a row the same bits
whatever batch it is in, and is what float32 layers use at the avx2 level. Each test runs at every ISA level this
CPU can run (the `isa` fixture, tests/conftest.py); the kernel has a path at the avx2 level only."""

import pytest
import torch

from pagedserve.kernels import f32_gemm
from pagedserve.layers.linear import Linear


def packed_or_skip(weight: torch.Tensor, isa: str) -> f32_gemm.PackedWeight:
    packed = f32_gemm.PackedWeight.of(weight)
    if packed is None:
        if isa == "avx2":
            pytest.skip("no C compiler: the avx2 level's packed float32 path could not be built")
        pytest.skip(f"{isa}: no packed float32 path (torch's sgemm is used: 512-bit FMAs above avx2, none below)")
    return packed


def test_packed_path_exists_at_the_avx2_level_only(isa):
    weight = torch.randn(32, 64)
    assert (f32_gemm.PackedWeight.of(weight) is not None) == (isa == "avx2" and f32_gemm.available())


# rows past a 6-row tile, past the 256-row panel; k past the 640-wide slice (partial sums go through the output)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 300])
@pytest.mark.parametrize("in_features", [96, 700])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch_linear(isa, rows, in_features, bias):
    g = torch.Generator().manual_seed(rows * in_features)
    weight = torch.randn(80, in_features, generator=g)
    b = torch.randn(80, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g)
    out = f32_gemm.linear(x, packed_or_skip(weight, isa), b)
    expected = (x.double() @ weight.double().t() + (b.double() if bias else 0)).float()
    assert out.shape == (rows, 80)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_a_rows_result_does_not_depend_on_its_batch(isa):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 1300, generator=g)
    packed = packed_or_skip(weight, isa)
    x = torch.randn(301, 1300, generator=g)
    batched = f32_gemm.linear(x, packed)
    for row in (0, 5, 6, 255, 256, 300):
        assert torch.equal(f32_gemm.linear(x[row:row + 1], packed)[0], batched[row])
        assert torch.equal(f32_gemm.linear(x[row - 3 if row >= 3 else 0:row + 4], packed)[min(row, 3)], batched[row])


def test_float32_layer_holds_only_the_packed_copy_and_computes_like_torch(isa):
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True)
    x = torch.randn(2, 9, 64)
    expected = layer(x).detach()
    packed = layer.pack_for_small_batches()
    assert packed == (isa == "avx2" and f32_gemm.available())
    if not packed:
        assert layer.weight.shape == (48, 64)  # torch's path keeps the plain weight
        return
    assert layer.held_packed_only and layer.weight.numel() == 0
    assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_naming_the_shape(isa):
    packed = packed_or_skip(torch.randn(16, 32), isa)
    with pytest.raises(ValueError, match=r"float32 \[M, 32\]"):
        f32_gemm.linear(torch.randn(4, 31), packed)
    with pytest.raises(ValueError, match="float32"):
        f32_gemm.linear(torch.randn(4, 32).bfloat16(), packed)
