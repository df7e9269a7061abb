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


STORAGES = ["float16 scales", "float32 scales", "symmetric", "super scales", "group scales"]
"""How pack stores a weight's scales: float16 (where exact: the default), float32, kind 4 with m = -8d left
implied (Q4_0), 8-bit multiples of float16 factors per 256 inputs (Q4_K and Q6_K: kinds 4 and 6), or a float16
scale and a zero point per 128 inputs (AWQ and GPTQ: kind 4)."""
KIND_STORAGES = [(kind, storage) for kind in (8, 4, 6) for storage in STORAGES
                 if (storage not in ("symmetric", "group scales") or kind == 4)
                 and (storage != "super scales" or kind != 8)]


def with_super_scales(weight: QuantizedTensor, seed: int = 0) -> QuantizedTensor:
    """The weight with random Q4_K / Q6_K-style scales: a float16 factor per 256 inputs times 8-bit codes."""
    g = torch.Generator().manual_seed(seed)
    n, k = weight.shape
    d = (torch.rand(n, k // 256, generator=g) * 0.002 + 1e-4).half()
    if weight.kind == 6:
        codes = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
        weight.super_scales = quant_gemm.SuperScales(d, codes)
        weight.scales = codes.float() * d.float().repeat_interleave(16, dim=1)
        return weight
    codes, min_codes = (torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8) for _ in range(2))
    min_d = (torch.rand(n, k // 256, generator=g) * 0.01).half()
    weight.super_scales = quant_gemm.SuperScales(d, codes, min_d, min_codes)
    weight.scales = d.float().repeat_interleave(8, dim=1) * codes.float()
    weight.offsets = -(min_d.float().repeat_interleave(8, dim=1) * min_codes.float())
    return weight


def with_group_scales(weight: QuantizedTensor, group_size: int = 128, seed: int = 0) -> QuantizedTensor:
    """The kind 4 weight with random AWQ / GPTQ-style scales: per group of inputs a float16 d and a zero point
    0..16, w = (q - z) * d."""
    g = torch.Generator().manual_seed(seed)
    n, k = weight.shape
    d = (torch.rand(n, k // group_size, generator=g) * 0.02 + 0.001).half()
    zeros = torch.randint(0, 17, (n, k // group_size), generator=g).to(torch.uint8)
    weight.group_scales = quant_gemm.GroupScales(d, zeros, group_size)
    weight.scales = d.float().repeat_interleave(group_size // 32, dim=1)
    weight.offsets = -(zeros.float() * d.float()).repeat_interleave(group_size // 32, dim=1)
    return weight


def pack(weight: QuantizedTensor, storage: str = "float16 scales") -> quant_gemm.QuantizedWeight:
    if storage == "group scales":
        weight = with_group_scales(weight)
        return quant_gemm.QuantizedWeight.pack(weight.codes, weight.scales, weight.offsets, 4, "test",
                                               group_scales=weight.group_scales)
    if storage == "super scales":
        weight = with_super_scales(weight)
        return quant_gemm.QuantizedWeight.pack(weight.codes, weight.scales, weight.offsets, weight.kind, "test",
                                               super_scales=weight.super_scales)
    offsets = -8.0 * weight.scales if storage == "symmetric" else weight.offsets
    packed = quant_gemm.QuantizedWeight.pack(weight.codes, weight.scales, offsets, weight.kind, "test",
                                             half_scales=storage != "float32 scales")
    weight.offsets = offsets  # the reference dequantizes what was packed
    return packed


def emulate_vnni(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """The VNNI path's arithmetic: x quantized per row and group of 32 in float32 as the kernel does it
    (s = amax / 127, xq = round-half-even(x / s)), then the products summed in float64."""
    m, k = x.shape
    xg = x.float().view(m, k // 32, 32)
    s = xg.abs().amax(-1, keepdim=True) / 127
    xq = torch.where(s > 0, torch.round(xg / torch.where(s > 0, s, 1)), 0)
    w = weight.dequantize().double().view(-1, k // 32, 32)
    return torch.einsum("mgi,ngi->mn", xq.double() * s.double(), w)


@pytest.mark.parametrize("kind, storage", KIND_STORAGES)
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_matches_its_reference(kind, storage, rows, dtype, isa):
    n, k = 48, 512
    weight = random_weight(n, k, kind)
    packed = pack(weight, storage)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(n).to(dtype)
    out = quant_gemm.linear(x, packed, bias).double()
    exact = x.double() @ weight.dequantize().double().T + bias.double()
    reference = (emulate_vnni(x, weight) + bias.double()) if quant_gemm.quantizes_activations() else exact
    rounding = 2 ** -7 if dtype == torch.bfloat16 else 1e-5  # the output's own rounding (relative)
    assert ((out - reference).abs() <= rounding * reference.abs() + 1e-4).all()
    # activation quantization (VNNI) costs at most about half a step of 1/127 of each group's largest value
    assert ((out - exact).abs() <= 0.02 * exact.abs().max()).all()


@pytest.mark.parametrize("kind, storage, bytes_per_weight", [
    (8, "float16 scales", 1.0625), (8, "float32 scales", 1.125), (4, "float16 scales", 0.625),
    (4, "float32 scales", 0.75), (4, "symmetric", 0.5625), (4, "super scales", 0.578125), (4, "group scales", 0.5234375),
    (6, "float16 scales", 0.875), (6, "float32 scales", 1.0), (6, "super scales", 0.8203125)])
def test_packed_weights_take_what_their_scales_need(kind, storage, bytes_per_weight):
    """float16 scales make Q8_0, Q4_1 and Q4_0 (symmetric) weights as small in memory as in the GGUF file; super
    scales Q6_K's (0.8203) and Q4_K's within 3% (0.5781 against 0.5625: a float16 Dmin and D per 16 columns);
    group scales AWQ's groups of 128 within 1% (0.5234 against 0.5195: d float16 and z 4 bits per group)."""
    packed = pack(random_weight(64, 256, kind), storage)
    assert packed.nbytes == 64 * 256 * bytes_per_weight


def test_scales_that_float16_cannot_hold_exactly_stay_float32():
    weight = random_weight(16, 64, 4)
    weight.scales[3, 1] = 1 / 3  # not a float16
    packed = quant_gemm.QuantizedWeight.pack(weight.codes, weight.scales, weight.offsets, 4, "test")
    assert packed.flags == 0 and packed.nbytes == 16 * 64 * 0.75
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(5))
    reference = emulate_vnni(x, weight) if quant_gemm.quantizes_activations() else x.double() @ weight.dequantize().double().T
    assert ((quant_gemm.linear(x, packed).double() - reference).abs() <= 1e-5 * reference.abs() + 1e-4).all()


@pytest.mark.parametrize("kind, storage", KIND_STORAGES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_of_a_packed_table_equal_the_dequantized_tables_rows(kind, storage, dtype, isa):
    """Token embeddings kept quantized: a looked-up row is the dequantized row, rounded to the dtype as copying
    the dequantized table into a parameter of that dtype would round it."""
    weight = random_weight(64, 256, kind, seed=21)
    packed = pack(weight, storage)
    ids = torch.tensor([[0, 63, 17], [17, 5, 40]])
    assert torch.equal(quant_gemm.rows(ids, packed, dtype), weight.dequantize().to(dtype)[ids])


@pytest.mark.parametrize("group_size, k", [(32, 256), (64, 256), (96, 384), (128, 512), (576, 576)])
def test_group_scales_give_the_per_32_float32_scales_results_bit_for_bit(group_size, k, isa):
    """A float16 d and a zero point per group (m = -(z d) computed in the kernel, exact) instead of float32 d and m
    per 32: the same outputs and rows. Groups that are not a power of two times 32 (96; 576: GPTQ's group_size -1
    on 576 inputs) are stored once per the largest such span that divides them."""
    weight = with_group_scales(random_weight(32, k, 4, seed=41), group_size, seed=42)
    grouped = quant_gemm.QuantizedWeight.pack(weight.codes, weight.scales, weight.offsets, 4, "test",
                                              group_scales=weight.group_scales)
    plain = quant_gemm.QuantizedWeight.pack(weight.codes, weight.scales, weight.offsets, 4, "test", half_scales=False)
    assert grouped.flags & quant_gemm.GROUP_SCALES and plain.flags == 0 and grouped.nbytes < plain.nbytes
    for rows in (1, 4, 13):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert torch.equal(quant_gemm.linear(x, grouped), quant_gemm.linear(x, plain))
    ids = torch.tensor([31, 0, 7])
    assert torch.equal(quant_gemm.rows(ids, grouped, torch.float32), weight.dequantize()[ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_input_order_gives_the_result_of_the_gathered_input(dtype, isa):
    """GPTQ act-order: the kernel takes x's columns in the weight's input order itself, bit for bit what a
    gathered copy of x gives."""
    packed = pack(random_weight(32, 256, 4, seed=51), "group scales")
    order = torch.randperm(256, generator=torch.Generator().manual_seed(53))
    for rows in (1, 9):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
        assert torch.equal(quant_gemm.linear(x, packed, input_order=order), quant_gemm.linear(x[:, order], packed))
    with pytest.raises(ValueError, match="input_order has shape \\(255,\\), expected \\(256,\\)"):
        quant_gemm.linear(x, packed, input_order=order[:255])


def test_group_scales_that_do_not_divide_the_inputs_are_refused():
    weight = with_group_scales(random_weight(16, 256, 4), 128)
    with pytest.raises(ValueError, match="scales per 128 inputs .*K a multiple of the group size"):
        quant_gemm.QuantizedWeight.pack(weight.codes[:, :192], weight.scales[:, :6], weight.offsets[:, :6], 4, "test",
                                        group_scales=quant_gemm.GroupScales(weight.group_scales.d[:, :1],
                                                                            weight.group_scales.zeros[:, :1], 128))


def test_rows_of_mixed_shards_and_ids_out_of_range():
    shards = [random_weight(32, 256, 4, seed=22), random_weight(16, 256, 6, seed=23), random_weight(16, 256, 6, seed=24),
              random_weight(16, 256, 4, seed=25)]
    joined = quant_gemm.QuantizedWeight.pack_shards([pack(shards[0]), pack(shards[1], "float32 scales"),
                                                     pack(shards[2], "super scales"), pack(shards[3], "group scales")])
    table = torch.cat([w.dequantize() for w in shards])
    ids = torch.arange(80).flip(0)
    assert torch.equal(quant_gemm.rows(ids, joined, torch.float32), table[ids])
    for bad in (80, -1):
        with pytest.raises(IndexError, match="ids must lie in 0..79"):
            quant_gemm.rows(torch.tensor([3, bad]), joined, torch.float32)


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
    reference = emulate_vnni(x, weight) if quant_gemm.quantizes_activations() else x.double() @ weight.dequantize().double().T
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
    shards = [random_weight(32, 256, 4, seed=11), random_weight(16, 256, 6, seed=12), random_weight(48, 256, 8, seed=13),
              with_super_scales(random_weight(16, 256, 4, seed=14)), with_super_scales(random_weight(32, 256, 6, seed=15)),
              with_group_scales(random_weight(16, 256, 4, seed=16), 64)]
    alone = [quant_gemm.QuantizedWeight.pack(w.codes, w.scales, w.offsets, w.kind, f"kind {w.kind}",
                                             half_scales=w.kind != 6, super_scales=w.super_scales,
                                             group_scales=w.group_scales) for w in shards]
    joined = quant_gemm.QuantizedWeight.pack_shards(alone)
    assert joined.kind == quant_gemm.MIXED and joined.out_features == 160 and joined.source_type == "kind 4+kind 6+kind 8"
    for rows in (1, 8, 11):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        bias = torch.randn(160).bfloat16()
        expected = torch.cat([quant_gemm.linear(x, w, b) for w, b in zip(alone, bias.split([32, 16, 48, 16, 32, 16]))], dim=1)
        assert torch.equal(quant_gemm.linear(x, joined, bias), expected)


@pytest.mark.parametrize("kind, storage", KIND_STORAGES)
def test_the_avx2_int8_path_gives_the_vnni_paths_results_bit_for_bit(kind, storage, monkeypatch):
    """Both sum the same int32 dot products and apply the same float operations per column, so a model computes
    the same tokens on an AVX2 machine as on a VNNI one."""
    from pagedserve.kernels import build

    if build.ISA_LEVELS.index(build.native_isa()) < build.ISA_LEVELS.index("avx512_bf16"):
        pytest.skip("CPU has no avx512_bf16 (AVX512-VNNI): the VNNI side of the comparison is not tested here")
    weight = random_weight(48, 512, kind, seed=31)
    packed = pack(weight, storage)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(32)).bfloat16()
    outputs = {}
    for level in ("avx512_bf16", "avx2"):
        monkeypatch.setenv("PAGEDSERVE_CPU_ISA", level)
        build.reset()
        outputs[level] = quant_gemm.linear(x, packed)
    build.reset()
    assert torch.equal(outputs["avx512_bf16"], outputs["avx2"])


@pytest.mark.parametrize("kind, code", [(8, -128), (8, 127), (4, 15), (6, 63)])
@pytest.mark.parametrize("sign", [1, -1])
def test_the_largest_codes_times_the_largest_activations_sum_exactly(kind, code, sign, isa):
    """Every product at its largest (|xq| = 127 everywhere): where the AVX2 path sums several quads in int16 lanes
    before widening, no lane overflows."""
    n, k = 16, 256
    codes = torch.full((n, k), code, dtype=torch.int8 if kind == 8 else torch.uint8).view(torch.uint8)
    weight = QuantizedTensor("w", None, codes, torch.full((n, k // (16 if kind == 6 else 32)), 0.5),
                             torch.zeros(n, k // 32), kind)
    x = torch.full((3, k), 2.0 * sign)
    out = quant_gemm.linear(x, pack(weight)).double()
    expected = x.double() @ weight.dequantize().double().T
    assert torch.allclose(out, expected, rtol=1e-6), (out[0, 0].item(), expected[0, 0].item())


def vnni_256_flags() -> tuple[str, ...]:
    """Extra gcc flags for an avx2-level build with 256-bit VNNI on this CPU: none where it has AVX-VNNI (the level
    adds -mavxvnni), AVX512-VNNI's EVEX form where it has that and AVX512VL; skips where it has neither."""
    from pagedserve.kernels import build

    flags = set(build.cpu_flags())
    if "avx_vnni" in flags:
        return ()
    if {"avx512_vnni", "avx512vl"} <= flags:
        return ("-mavx512vnni", "-mavx512vl")
    pytest.skip("CPU has no AVX-VNNI or AVX512-VNNI: the AVX2 path's 256-bit VNNI form is not tested here")


@pytest.mark.parametrize("kind, storage", KIND_STORAGES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_avx2_paths_vnni_and_maddubs_forms_give_the_same_results_bit_for_bit(kind, storage, dtype, monkeypatch):
    """AVX2 CPUs with AVX-VNNI (Alder Lake, Sierra Forest) sum the same int32 products with one VPDPBUSD as the
    others with maddubs + madd, so they compute the same tokens; also at 1 row, a full pass and a partial one."""
    from pagedserve.kernels import build

    extra = vnni_256_flags()
    weight = random_weight(48, 512, kind, seed=41)
    packed = pack(weight, storage)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(42)).to(dtype)
    bias = torch.randn(48).to(dtype)
    outputs = {}
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "avx2")
    for path, flags in ((3, extra), (2, ("-mno-avxvnni",))):
        build.reset()
        build.load_library("quant_gemm", flags)
        assert quant_gemm._lib().int8_path() == path, quant_gemm.kernel_name()
        outputs[path] = [quant_gemm.linear(x[:rows], packed, bias) for rows in (1, 4, 11)]
    build.reset()
    for vnni, maddubs in zip(outputs[3], outputs[2]):
        assert torch.equal(vnni, maddubs)


def test_asking_for_float16_scales_that_are_no_float16_values_is_an_error():
    weight = random_weight(16, 64, 4)
    weight.scales[0, 0] = 1 / 3
    with pytest.raises(ValueError, match="half_scales=True, but a scale or offset is no float16 value"):
        quant_gemm.QuantizedWeight.pack(weight.codes, weight.scales, weight.offsets, 4, "test", half_scales=True)
