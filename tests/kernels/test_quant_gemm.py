"""The quantized matmul (kernels/quant_gemm.py) against references, at every ISA level this CPU can run:
where it dequantizes tiles (every level but avx512_bf16), it equals float32 matmul with the dequantized
weights up to summation order; with VNNI it equals the same arithmetic on int8-quantized activations
(emulated in float64 here), and stays within the activation rounding of the float result."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import quant_gemm
from pagedserve.quantization.quantized_tensor import QuantizedTensor


def random_weight(n: int, k: int, kind: int, seed: int = 0) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    groups = k // 32
    if kind == 8:
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).view(torch.uint8)
    else:
        codes = torch.randint(0, 64 if kind == 6 else 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups * (2 if kind == 6 else 1), generator=g) * 0.02 + 0.001).half().float()
    offsets = torch.zeros(n, groups) if kind != 4 else -(torch.rand(n, groups, generator=g) * 0.1).half().float()
    return QuantizedTensor("w", None, codes, scales, offsets, kind)


def emulate_vnni(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """The VNNI path's arithmetic: x quantized per row and group of 32 in float32 as the kernel does it
    (s = amax / 127, xq = round-half-even(x / s)), then the products summed in float64."""
    m, k = x.shape
    xg = x.float().view(m, k // 32, 32)
    s = xg.abs().amax(-1, keepdim=True) / 127
    xq = torch.where(s > 0, torch.round(xg / torch.where(s > 0, s, 1)), 0)
    w = weight.dequantize().double().view(-1, k // 32, 32)
    return torch.einsum("mgi,ngi->mn", xq.double() * s.double(), w)


@pytest.mark.parametrize("kind", [8, 4, 6])
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_matches_its_reference(kind, rows, dtype, isa):
    n, k = 48, 96
    weight = random_weight(n, k, kind)
    packed = quant_gemm.QuantizedWeight.pack(weight.codes, weight.scales, weight.offsets, kind, "test")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(n).to(dtype)
    out = quant_gemm.linear(x, packed, bias).double()
    exact = x.double() @ weight.dequantize().double().T + bias.double()
    reference = (emulate_vnni(x, weight) + bias.double()) if quant_gemm.uses_vnni() else exact
    rounding = 2 ** -7 if dtype == torch.bfloat16 else 1e-5  # the output's own rounding (relative)
    assert ((out - reference).abs() <= rounding * reference.abs() + 1e-4).all()
    # activation quantization (VNNI) costs at most about half a step of 1/127 of each group's largest value
    assert ((out - exact).abs() <= 0.02 * exact.abs().max()).all()


def test_a_row_gives_the_same_result_alone_and_in_a_batch(isa):
    weight = random_weight(32, 64, 4, seed=3)
    packed = quant_gemm.QuantizedWeight.pack(weight.codes, weight.scales, weight.offsets, 4, "test")
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(4))
    assert torch.equal(quant_gemm.linear(x, packed)[7], quant_gemm.linear(x[7:8], packed)[0])


def test_shapes_the_kernel_cannot_take_are_refused():
    weight = random_weight(16, 64, 8)
    with pytest.raises(ValueError, match="needs N % 16 == 0, K % 32 == 0"):
        quant_gemm.QuantizedWeight.pack(weight.codes[:8], weight.scales[:8], None, 8, "test")


@pytest.mark.parametrize("kind", [8, 4, 6])
def test_many_column_blocks_and_a_long_k_match_the_dequantized_matmul(kind, isa):
    weight = random_weight(256, 1536, kind, seed=7)
    packed = quant_gemm.QuantizedWeight.pack(weight.codes, weight.scales, weight.offsets, kind, "test")
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(8))
    out = quant_gemm.linear(x, packed).double()
    reference = emulate_vnni(x, weight) if quant_gemm.uses_vnni() else x.double() @ weight.dequantize().double().T
    assert ((out - reference).abs() <= 1e-5 * reference.abs() + 1e-4).all()


@pytest.mark.parametrize("kind", [8, 4, 6])
def test_a_nan_in_a_row_makes_that_rows_outputs_nan_and_no_other(kind, isa):
    weight = random_weight(32, 64, kind, seed=9)
    packed = quant_gemm.QuantizedWeight.pack(weight.codes, weight.scales, weight.offsets, kind, "test")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(10))
    x[1, 40] = float("nan")
    x[2] = 0  # an all-zero row: scale 0, outputs exactly 0
    out = quant_gemm.linear(x, packed)
    assert out[1].isnan().all() and not out[0].isnan().any() and torch.equal(out[2], torch.zeros(32))


def test_activations_the_kernel_cannot_take_are_a_clear_error():
    weight = random_weight(16, 64, 8)
    packed = quant_gemm.QuantizedWeight.pack(weight.codes, weight.scales, weight.offsets, 8, "test")
    with pytest.raises(ValueError, match="CPU float32 or bfloat16 activations of 64 features"):
        quant_gemm.linear(torch.randn(2, 64).half(), packed)
    with pytest.raises(ValueError, match="of 64 features, got torch.float32 \\(2, 32\\)"):
        quant_gemm.linear(torch.randn(2, 32), packed)


def test_shards_of_different_kinds_packed_together_give_each_shards_own_result(isa):
    """A fused linear of Q4_K q/k and a Q6_K v (Q4_K_M files) is packed as one weight of mixed column blocks:
    each shard's outputs are bit for bit those of the shard alone."""
    shards = [random_weight(32, 96, 4, seed=11), random_weight(16, 96, 6, seed=12), random_weight(48, 96, 8, seed=13)]
    alone = [quant_gemm.QuantizedWeight.pack(w.codes, w.scales, w.offsets, w.kind, f"kind {w.kind}") for w in shards]
    joined = quant_gemm.QuantizedWeight.pack_shards(alone)
    assert joined.kind == quant_gemm.MIXED and joined.out_features == 96 and joined.source_type == "kind 4+kind 6+kind 8"
    for rows in (1, 8, 11):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
        bias = torch.randn(96).bfloat16()
        expected = torch.cat([quant_gemm.linear(x, w, b) for w, b in zip(alone, bias.split([32, 16, 48]))], dim=1)
        assert torch.equal(quant_gemm.linear(x, joined, bias), expected)
