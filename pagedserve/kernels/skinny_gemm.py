"""bfloat16 linear layers for small batches (csrc/skinny_gemm.c): weights laid out once for AVX-512 BF16 dot
products, so that a decode step with few sequences streams each weight once instead of having the BLAS
re-lay it out on every call (about 3x faster at 16 rows here, see docs/benchmarks.md).

`PackedWeight.of(weight)` packs a [N, K] bf16 weight (None where the kernel cannot run: no AVX-512 BF16, no
compiler, other dtypes or shapes); `linear(x, packed, bias)` computes x @ weight.T + bias for x [M, K].
Layers use it for M <= MAX_ROWS and torch above, where the BLAS is at full speed.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from pagedserve.kernels.build import load_library

MAX_ROWS = 32
"""Up to this many rows the packed kernel beats torch's bf16 matmul here (measured: 2.9x at 1 row, 1.5x at
16, 1.15x at 32, even at 64); above, torch's BLAS is as fast or faster."""

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_library: Optional[ctypes.CDLL] = None
_checked = False


def _lib() -> Optional[ctypes.CDLL]:
    global _library, _checked
    if not _checked:
        _checked = True
        library = load_library("skinny_gemm")
        if library is not None and library.available():
            library.pack_weight.argtypes = [_P, _P, _I64, _I64]
            library.skinny_gemm.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, _INT]
            library.pack_weight.restype = library.skinny_gemm.restype = _INT
            _library = library
    return _library


@dataclass(frozen=True)
class PackedWeight:
    data: torch.Tensor
    """[N / 16, K / 2, 16, 2] bf16."""
    out_features: int
    in_features: int

    @staticmethod
    def of(weight: torch.Tensor) -> Optional["PackedWeight"]:
        n, k = weight.shape
        if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or n % 16 or k % 2
                or _lib() is None):
            return None
        weight = weight.detach().contiguous()
        data = torch.empty(n // 16, k // 2, 16, 2, dtype=torch.bfloat16)
        if _lib().pack_weight(weight.data_ptr(), data.data_ptr(), n, k) != 0:
            return None
        return PackedWeight(data, n, k)


def linear(x: torch.Tensor, packed: PackedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] bf16 (fp32 sums, rounded once, bias added before rounding)."""
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, packed.out_features, dtype=torch.bfloat16)
    if bias is not None:
        bias = bias.detach().contiguous()
    status = _lib().skinny_gemm(x.data_ptr(), packed.data.data_ptr(), bias.data_ptr() if bias is not None else None,
                                y.data_ptr(), m, packed.out_features, packed.in_features, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"skinny_gemm failed (status {status})")
    return y
