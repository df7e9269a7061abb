"""The small-batch bf16 matmul equals torch's linear (to bf16 rounding), and layers use it only where it pays."""

import pytest
import torch

from pagedserve.kernels import skinny_gemm
from pagedserve.layers.linear import Linear

needs_kernel = pytest.mark.skipif(skinny_gemm.PackedWeight.of(torch.zeros(16, 2, dtype=torch.bfloat16)) is None,
                                  reason="no AVX-512 BF16 or no compiler")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 160, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 160, generator=g).bfloat16()
    out = skinny_gemm.linear(x, skinny_gemm.PackedWeight.of(weight), b)
    exact = x.float() @ weight.float().t() + (b.float() if bias else 0)
    expected = torch.nn.functional.linear(x, weight, b)
    # Both sum the same products in float32 and round once; only the order of the sums may differ.
    assert torch.allclose(out.float(), exact, rtol=1e-2, atol=1e-2)
    assert (out == expected).float().mean() > 0.99


@needs_kernel
def test_each_row_is_independent_of_the_others():
    g = torch.Generator().manual_seed(0)
    packed = skinny_gemm.PackedWeight.of(torch.randn(64, 128, generator=g).bfloat16())
    x = torch.randn(20, 128, generator=g).bfloat16()
    together = skinny_gemm.linear(x, packed)
    alone = torch.cat([skinny_gemm.linear(x[i:i + 1], packed) for i in range(20)])
    assert torch.equal(together, alone)


def test_weights_the_kernel_cannot_take_are_not_packed():
    assert skinny_gemm.PackedWeight.of(torch.zeros(32, 8)) is None  # float32
    assert skinny_gemm.PackedWeight.of(torch.zeros(24, 8, dtype=torch.bfloat16)) is None  # 24 % 16 != 0


@needs_kernel
def test_linear_layer_uses_the_packed_copy_only_for_small_batches():
    layer = Linear(64, 48, bias=True).bfloat16()
    assert layer.pack_for_small_batches()
    small = torch.randn(skinny_gemm.MAX_ROWS, 64).bfloat16()
    large = torch.randn(skinny_gemm.MAX_ROWS + 1, 64).bfloat16()
    layer.packed = skinny_gemm.PackedWeight(torch.zeros_like(layer.packed.data), 48, 64)  # a visibly wrong copy
    assert torch.equal(layer(small), layer.bias.expand(skinny_gemm.MAX_ROWS, 48))  # bias only: packed path
    assert torch.equal(layer(large), torch.nn.functional.linear(large, layer.weight, layer.bias))
