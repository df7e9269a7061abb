"""Linear layers on block-quantized weights (csrc/quant_gemm.c): GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K weights kept
quantized in memory and computed from directly, for any number of rows.

Paths by ISA level (kernels/build.py): avx512_bf16 (whose CPUs all have AVX512-VNNI) quantizes the activations
per row and group of 32 to int8 and uses VNNI int8 dot products; every other level dequantizes each
weight record into a float32 tile and multiplies the float activations in (no activation quantization).
`QuantizedWeight.pack(...)` lays a weight out once; `linear(x, weight, bias)` computes x @ w.T + bias.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from pagedserve.kernels.build import load_library

GROUP = 32
KINDS = (8, 4)
"""8: w = d * q, q int8 (Q8_0). 4: w = d * q + m, q in 0..15 (Q4_0, Q4_1, Q4_K)."""
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _lib() -> Optional[ctypes.CDLL]:
    library = load_library("quant_gemm")
    if library is not None and getattr(library, "_typed", None) is None:
        library.pack_weight.argtypes = [_P, _P, _P, _P, _I64, _I64, _INT]
        library.packed_bytes.argtypes = [_I64, _I64, _INT]
        library.packed_bytes.restype = _I64
        library.quant_gemm.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, _INT, _INT, _INT]
        library.pack_weight.restype = library.quant_gemm.restype = library.vnni.restype = _INT
        library._typed = True
    return library


def available() -> bool:
    return _lib() is not None


def uses_vnni() -> bool:
    """Whether the kernel in force quantizes activations and uses VNNI dot products (else: float tiles)."""
    return available() and bool(_lib().vnni())


@dataclass(frozen=True)
class QuantizedWeight:
    data: torch.Tensor
    """uint8 records (csrc/quant_gemm.c's layout)."""
    kind: int
    out_features: int
    in_features: int
    source_type: str
    """The GGUF type the weight came from (Q8_0, Q4_1, ...), for logs."""

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @staticmethod
    def pack(codes: torch.Tensor, scales: torch.Tensor, offsets: Optional[torch.Tensor], kind: int,
             source_type: str) -> "QuantizedWeight":
        """codes [N, K] (int8 for kind 8, uint8 0..15 for kind 4), scales / offsets [N, K / 32] float32
        (offsets only for kind 4)."""
        n, k = codes.shape
        if kind not in KINDS or n % 16 or k % GROUP or tuple(scales.shape) != (n, k // GROUP):
            raise ValueError(f"cannot pack a [{n}, {k}] weight of kind {kind} (needs N % 16 == 0, K % 32 == 0)")
        library = _lib()
        if library is None:
            raise RuntimeError("the quantized matmul kernel is not available here (no C compiler?)")
        codes = codes.contiguous().view(torch.uint8)
        scales = scales.float().contiguous()
        offsets = torch.zeros_like(scales) if offsets is None else offsets.float().contiguous()
        data = torch.empty(library.packed_bytes(n, k, kind), dtype=torch.uint8)
        if library.pack_weight(codes.data_ptr(), scales.data_ptr(), offsets.data_ptr(), data.data_ptr(), n, k, kind):
            raise RuntimeError("quant_gemm pack_weight failed")
        return QuantizedWeight(data, kind, n, k, source_type)


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] float32 or bf16 -> [M, N] of the same dtype (float32 sums, bias added before rounding)."""
    if x.dtype not in _DTYPES or x.device.type != "cpu" or x.shape[-1] != weight.in_features:
        raise ValueError(f"quantized linear takes CPU float32 or bfloat16 activations of {weight.in_features} "
                         f"features, got {x.dtype} {tuple(x.shape)} on {x.device.type}")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, weight.out_features, dtype=x.dtype)
    if bias is not None:
        bias = bias.detach().to(x.dtype).contiguous()
    status = _lib().quant_gemm(x.data_ptr(), weight.data.data_ptr(), None if bias is None else bias.data_ptr(),
                               y.data_ptr(), m, weight.out_features, weight.in_features, weight.kind,
                               _DTYPES[x.dtype], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"quant_gemm failed (status {status})")
    return y
