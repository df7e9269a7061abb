"""Linear layers on block-quantized weights (csrc/quant_gemm.c): GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights
kept quantized in memory and computed from directly, for any number of rows.

Paths by ISA level (kernels/build.py): avx512_bf16 (whose CPUs all have AVX512-VNNI), and avx512 on CPUs with
AVX512-VNNI, quantize the activations per row and group of 32 to int8 and use 512-bit VNNI int8 dot products;
avx2 and avx512 otherwise do the same 8 columns at a time, with 256-bit VNNI where the CPU has AVX-VNNI, else
with AVX2's maddubs (the same int32 sums, the same float operations: the same results); generic dequantizes
each weight record into a float32 tile and multiplies the float activations in (no activation quantization).
`QuantizedWeight.pack(...)` lays a weight out once (`pack_shards` a fused linear whose shards have different
kinds), with float16 scales where every scale and offset is one exactly (Q8_0, Q4_0, Q4_1: the weight then takes
what the file does), no stored offsets where they are -8 x the scale (Q4_0), and the scales of Q4_K / Q6_K
(SuperScales) and of AWQ / GPTQ (GroupScales) as their files hold them; `linear(x, weight, bias)`
computes x @ w.T + bias, and `rows(ids, weight, dtype)` dequantizes rows of a weight used as a table (token
embeddings that are also the LM head).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pagedserve.kernels.build import load_library

GROUP = 32
KINDS = (8, 4, 6)
"""8: w = d * q, q int8 (Q8_0). 4: w = d * q + m, q in 0..15 (Q4_0, Q4_1, Q4_K). 6: w = d * (q - 32), q in 0..63,
d per 16 (Q6_K)."""
MIXED = 1
"""The kind of a weight packed by pack_shards: its column blocks have kinds of their own."""
HALF_SCALES, SYMMETRIC, SUPER_SCALES, GROUP_SCALES = 16, 32, 64, 128
"""Flags on the kind the C code takes (csrc/quant_gemm.c): scales stored as float16; kind 4 with m = -8d; scales
as 8-bit multiples of float16 factors per 256 inputs (Q4_K, Q6_K); kind 4 with a float16 scale and an integer zero
point per 2^span groups of 32 (AWQ, GPTQ), span in the kind's bits 8-11."""
SPAN_SHIFT, MAX_SPAN = 8, 15
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
Allocate = Callable[[int], torch.Tensor]
"""Where pack puts a weight: num_bytes -> a uint8 tensor of that many bytes (e.g. HugePageArena.take)."""


def _lib() -> Optional[ctypes.CDLL]:
    library = load_library("quant_gemm")
    if library is not None and getattr(library, "_typed", None) is None:
        library.pack_weight.argtypes = [_P, _P, _P, _P, _P, _P, _I64, _I64, _INT]
        library.packed_bytes.argtypes = [_I64, _I64, _INT]
        library.packed_bytes.restype = _I64
        library.quant_gemm.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, _INT, _INT, _INT, _P]
        library.dequantize_rows.argtypes = [_P, _P, _I64, _P, _I64, _I64, _INT, _INT, _INT]
        for function in (library.pack_weight, library.quant_gemm, library.int8_path, library.dequantize_rows):
            function.restype = _INT
        library._typed = True
    return library


def _required_lib() -> ctypes.CDLL:
    library = _lib()
    if library is None:
        raise RuntimeError("the quantized matmul kernel is not available here (no C compiler?)")
    return library


def available() -> bool:
    return _lib() is not None


def quantizes_activations() -> bool:
    """Whether the kernel in force quantizes activations to int8 and uses integer dot products (VNNI or AVX2),
    else it multiplies float activations into dequantized tiles."""
    return available() and bool(_lib().int8_path())


def kernel_name() -> str:
    """The path in force, for logs and benchmarks."""
    if not available():
        return "none (no C compiler)"
    return {1: "AVX512-VNNI int8", 2: "AVX2 int8 (maddubs)", 3: "AVX2 int8 (256-bit VNNI)"}.get(_lib().int8_path(),
                                                                                              "float32 tiles")


@dataclass(frozen=True)
class SuperScales:
    """Q4_K / Q6_K scales as their files hold them, per 256 inputs a float16 factor and per group (Q6_K: per 16)
    an 8-bit multiple of it: a group's scale is d x code, Q4_K's offset -(min_d x min_code), each product exact
    in float32. Kept so, they cost what the file's do (QuantizedWeight.pack)."""

    d: torch.Tensor
    """[N, K / 256] float16."""
    codes: torch.Tensor
    """[N, K / 32] uint8 0..63 (Q4_K) or [N, K / 16] int8 (Q6_K)."""
    min_d: Optional[torch.Tensor] = None
    """[N, K / 256] float16 (Q4_K)."""
    min_codes: Optional[torch.Tensor] = None
    """[N, K / 32] uint8 0..63 (Q4_K)."""

    def rows(self, index: torch.Tensor) -> "SuperScales":
        return SuperScales(*(None if t is None else t[index] for t in self._parts()))

    @staticmethod
    def cat(parts: list["SuperScales"]) -> "SuperScales":
        """The scales of the parts' rows, in order."""
        return SuperScales(*(None if ts[0] is None else torch.cat(ts) for ts in zip(*(p._parts() for p in parts))))

    def _parts(self) -> tuple:
        return self.d, self.codes, self.min_d, self.min_codes


@dataclass(frozen=True)
class GroupScales:
    """AWQ / GPTQ scales as their checkpoints hold them: per output and group of `group_size` inputs a float16
    scale d and an integer zero point z, w = (q - z) * d (kind 4 with m = -(z * d), exact in float32). Kept so,
    a weight costs about what the checkpoint's qweight, qzeros and scales do (QuantizedWeight.pack)."""

    d: torch.Tensor
    """[N, K / group_size] float16."""
    zeros: torch.Tensor
    """[N, K / group_size] uint8 (0..16: GPTQ's z - 1 format stores 15 for 16)."""
    group_size: int
    """A multiple of 32."""

    def rows(self, index: torch.Tensor) -> "GroupScales":
        return GroupScales(self.d[index], self.zeros[index], self.group_size)

    @staticmethod
    def cat(parts: list["GroupScales"]) -> "GroupScales":
        """The scales of the parts' rows, in order (one group size)."""
        if len({p.group_size for p in parts}) > 1:
            raise ValueError("GroupScales.cat takes parts of one group size")
        return GroupScales(torch.cat([p.d for p in parts]), torch.cat([p.zeros for p in parts]), parts[0].group_size)

    def span(self) -> int:
        """log2 of the groups of 32 per stored scale group: the largest power of two (at most 2^15) dividing
        group_size / 32; a larger group's scales are stored once per such span."""
        groups = self.group_size // GROUP
        return min((groups & -groups).bit_length() - 1, MAX_SPAN)


@dataclass(frozen=True)
class QuantizedWeight:
    data: torch.Tensor
    """uint8 records (csrc/quant_gemm.c's layout)."""
    kind: int
    out_features: int
    in_features: int
    source_type: str
    """The GGUF type the weight came from (Q8_0, Q4_1, ...), for logs."""
    flags: int = 0
    """HALF_SCALES, SYMMETRIC, SUPER_SCALES or GROUP_SCALES (with its span), as pack chose them (0 for MIXED: its
    table holds each block's)."""

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def kernel_kind(self) -> int:
        """The kind with its flags, as the C functions take it."""
        return self.kind | self.flags

    @staticmethod
    def pack(codes: torch.Tensor, scales: torch.Tensor, offsets: Optional[torch.Tensor], kind: int,
             source_type: str, half_scales: Optional[bool] = None,
             super_scales: Optional[SuperScales] = None, group_scales: Optional[GroupScales] = None,
             allocate: Optional[Allocate] = None) -> "QuantizedWeight":
        """codes [N, K] (int8 for kind 8, uint8 0..15 for kind 4, 0..63 for kind 6), scales [N, K / 32] float32
        ([N, K / 16] for kind 6), offsets [N, K / 32] float32 (used by kind 4 only). half_scales: store the
        scales as float16 (None: where that is exact; True: they must be float16 values, else a ValueError;
        False: float32). super_scales (kinds 4 and 6, K % 256 == 0): store the
        scales in that form instead (`scales` and `offsets` are then its products, and unread); so group_scales
        (kind 4, K % group_size == 0). allocate: where the records go (default: a new tensor)."""
        allocate = allocate or _new_bytes
        if super_scales is not None:
            return QuantizedWeight._pack_super(codes, super_scales, kind, source_type, allocate)
        if group_scales is not None:
            return QuantizedWeight._pack_groups(codes, group_scales, kind, source_type, allocate)
        n, k = codes.shape
        group = 16 if kind == 6 else GROUP
        if kind not in KINDS or n % 16 or k % GROUP or tuple(scales.shape) != (n, k // group):
            raise ValueError(f"cannot pack a [{n}, {k}] weight of kind {kind} (needs N % 16 == 0, K % 32 == 0)")
        library = _required_lib()
        scales = scales.float().contiguous()
        offsets = torch.zeros(n, k // GROUP) if offsets is None or kind != 4 else offsets.float().contiguous()
        flags = SYMMETRIC if kind == 4 and torch.equal(offsets, -8.0 * scales) else 0
        exact = _exact_in_half(scales) and (kind != 4 or _exact_in_half(offsets))
        if half_scales and not exact:
            raise ValueError("half_scales=True, but a scale or offset is no float16 value (it would be rounded)")
        half_scales = exact if half_scales is None else half_scales
        if half_scales:
            flags |= HALF_SCALES
            scales, offsets = scales.half(), offsets.half()
        data = allocate(library.packed_bytes(n, k, kind | flags))
        if library.pack_weight(codes.contiguous().view(torch.uint8).data_ptr(), scales.data_ptr(),
                               offsets.data_ptr(), None, None, data.data_ptr(), n, k, kind | flags):
            raise RuntimeError("quant_gemm pack_weight failed")
        return QuantizedWeight(data, kind, n, k, source_type, flags)

    @staticmethod
    def _pack_super(codes: torch.Tensor, scales: SuperScales, kind: int, source_type: str,
                    allocate: Allocate) -> "QuantizedWeight":
        n, k = codes.shape
        per = 16 if kind == 6 else 32
        if (kind not in (4, 6) or n % 16 or k % 256 or tuple(scales.d.shape) != (n, k // 256)
                or tuple(scales.codes.shape) != (n, k // per)):
            raise ValueError(f"cannot pack a [{n}, {k}] weight of kind {kind} with super-block scales "
                             "(needs kind 4 or 6, N % 16 == 0, K % 256 == 0)")
        d, sc = scales.d.half().contiguous(), scales.codes.contiguous().view(torch.uint8)
        dmin = scales.min_d.half().contiguous() if kind == 4 else d
        mn = scales.min_codes.contiguous().view(torch.uint8) if kind == 4 else sc
        library = _required_lib()
        data = allocate(library.packed_bytes(n, k, kind | SUPER_SCALES))
        if library.pack_weight(codes.contiguous().view(torch.uint8).data_ptr(), d.data_ptr(), dmin.data_ptr(),
                               sc.data_ptr(), mn.data_ptr(), data.data_ptr(), n, k, kind | SUPER_SCALES):
            raise RuntimeError("quant_gemm pack_weight failed")
        return QuantizedWeight(data, kind, n, k, source_type, SUPER_SCALES)

    @staticmethod
    def _pack_groups(codes: torch.Tensor, scales: GroupScales, kind: int, source_type: str,
                     allocate: Allocate) -> "QuantizedWeight":
        n, k = codes.shape
        size = scales.group_size
        if (kind != 4 or n % 16 or size % GROUP or k % size or tuple(scales.d.shape) != (n, k // size)
                or tuple(scales.zeros.shape) != (n, k // size)):
            raise ValueError(f"cannot pack a [{n}, {k}] weight of kind {kind} with scales per {size} inputs "
                             "(needs kind 4, N % 16 == 0, K a multiple of the group size, a multiple of 32)")
        span = scales.span()
        repeat = size // (GROUP << span)  # scale groups the kernel's span splits each group into
        d = scales.d.half().repeat_interleave(repeat, dim=1).contiguous()
        zeros = scales.zeros.to(torch.uint8).repeat_interleave(repeat, dim=1).contiguous()
        flags = GROUP_SCALES | (span << SPAN_SHIFT)
        library = _required_lib()
        data = allocate(library.packed_bytes(n, k, kind | flags))
        if library.pack_weight(codes.contiguous().data_ptr(), d.data_ptr(), None, None, zeros.data_ptr(),
                               data.data_ptr(), n, k, kind | flags):
            raise RuntimeError("quant_gemm pack_weight failed")
        return QuantizedWeight(data, kind, n, k, source_type, flags)

    @staticmethod
    def pack_shards(shards: list["QuantizedWeight"], allocate: Optional[Allocate] = None) -> "QuantizedWeight":
        """One weight of the shards' rows in order (each packed alone, with the same in_features), whatever
        their kinds: a table of (offset, kind) per block of 16 columns, then the shards' records (copied into
        `allocate`'s bytes, default a new tensor)."""
        k = shards[0].in_features
        if any(s.in_features != k or s.kind not in KINDS for s in shards):
            raise ValueError("pack_shards takes packed shards of one in_features")
        n = sum(s.out_features for s in shards)
        table = torch.empty(n // 16, 2, dtype=torch.int64)
        offset, block = table.numel() * 8, 0
        for shard in shards:
            blocks = shard.out_features // 16
            table[block:block + blocks, 0] = offset + torch.arange(blocks) * (shard.nbytes // blocks)
            table[block:block + blocks, 1] = shard.kernel_kind
            offset, block = offset + shard.nbytes, block + blocks
        parts = [table.view(-1).view(torch.uint8), *(s.data for s in shards)]
        data = (allocate or _new_bytes)(sum(p.numel() for p in parts))
        torch.cat(parts, out=data)
        return QuantizedWeight(data, MIXED, n, k, "+".join(dict.fromkeys(s.source_type for s in shards)))


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: Optional[torch.Tensor] = None,
           input_order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] float32 or bf16 -> [M, N] of the same dtype (float32 sums, bias added before rounding).
    input_order (int64 [K], a permutation): the weight's inputs are x's columns in that order (GPTQ act-order);
    the kernel gathers them."""
    if x.dtype not in _DTYPES or x.device.type != "cpu" or x.shape[-1] != weight.in_features:
        raise ValueError(f"quantized linear takes CPU float32 or bfloat16 activations of {weight.in_features} "
                         f"features, got {x.dtype} {tuple(x.shape)} on {x.device.type}")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, weight.out_features, dtype=x.dtype)
    if bias is not None:
        bias = bias.detach().to(x.dtype).contiguous()
    if input_order is not None:
        if tuple(input_order.shape) != (weight.in_features,):
            raise ValueError(f"input_order has shape {tuple(input_order.shape)}, expected ({weight.in_features},)")
        input_order = input_order.to(torch.int64).contiguous()
    status = _lib().quant_gemm(x.data_ptr(), weight.data.data_ptr(), None if bias is None else bias.data_ptr(),
                               y.data_ptr(), m, weight.out_features, weight.in_features, weight.kernel_kind,
                               _DTYPES[x.dtype], torch.get_num_threads(),
                               None if input_order is None else input_order.data_ptr())
    if status != 0:
        raise RuntimeError(f"quant_gemm failed (status {status})")
    return y


def rows(ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (any shape, int) of the [N, K] weight used as a lookup table -> [*ids.shape, K] in dtype
    (float32 or bf16): each the float32 dequantized row exactly, rounded to dtype. An id outside 0..N-1 is an
    IndexError."""
    if dtype not in _DTYPES:
        raise ValueError(f"quantized rows come as float32 or bfloat16, not {dtype}")
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), weight.in_features, dtype=dtype)
    status = _lib().dequantize_rows(weight.data.data_ptr(), flat.data_ptr(), flat.numel(), out.data_ptr(),
                                    weight.out_features, weight.in_features, weight.kernel_kind, _DTYPES[dtype],
                                    torch.get_num_threads())
    if status == 3:
        raise IndexError(f"index out of range: ids must lie in 0..{weight.out_features - 1}")
    if status != 0:
        raise RuntimeError(f"quant_gemm dequantize_rows failed (status {status})")
    return out.view(*ids.shape, weight.in_features)


def _new_bytes(num_bytes: int) -> torch.Tensor:
    return torch.empty(num_bytes, dtype=torch.uint8)


def _exact_in_half(values: torch.Tensor) -> bool:
    return torch.equal(values.half().float(), values)
