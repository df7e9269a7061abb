"""float32 linear layers with weights packed once (csrc/f32_gemm.c), for the avx2 level: CPUs whose fastest dtype
is float32 and whose widest vectors are AVX2's (AMD EPYC before Zen 4). There torch's float32 matmul (MKL's
sgemm) re-packs the weights on every call and runs well below the FMA peak on a small model's shapes; the packed
kernel is faster at every row count measured (1 to 2,048 rows; docs/benchmarks.md), so layers hold only the
packed copy and use it for every batch.

Paths by ISA level (kernels/build.py): avx2 only. At avx512 and avx512_bf16 torch's sgemm has 512-bit FMAs and
the library has no path; at generic neither. `PackedWeight.of(weight)` returns None where there is no path (and
for other dtypes, devices or shapes), and layers keep torch's.

Every output is summed in fp32 in k order, whatever the number of rows: a row's result does not depend on the
batch it is computed in.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from pagedserve.kernels.build import load_library

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _lib() -> Optional[ctypes.CDLL]:
    """The library for the ISA level in force, or None where it has no path."""
    library = load_library("f32_gemm")
    if library is None:
        return None
    if not hasattr(library, "_has_path"):
        library.pack_weight.argtypes = [_P, _P, _I64, _I64]
        library.f32_gemm.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, _INT]
        library.pack_weight.restype = library.f32_gemm.restype = library.available.restype = _INT
        library._has_path = bool(library.available())
    return library if library._has_path else None


def available() -> bool:
    """Whether the packed float32 kernel runs at this ISA level."""
    return _lib() is not None


@dataclass(frozen=True)
class PackedWeight:
    data: torch.Tensor
    """float32 [N / 16, K, 16]: for each block of 16 output columns, k by k."""
    out_features: int
    in_features: int

    @staticmethod
    def packed_shape(weight: torch.Tensor) -> Optional[tuple[int, ...]]:
        """The packed layout's shape for this weight, or None where the kernel cannot take it."""
        n, k = weight.shape
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or n % 16 or k == 0 or _lib() is None:
            return None
        return (n // 16, k, 16)

    @staticmethod
    def of(weight: torch.Tensor, out: Optional[torch.Tensor] = None) -> Optional["PackedWeight"]:
        """Pack `weight` [N, K] (into `out`, a float32 tensor of packed_shape's size, when given); None where the
        kernel cannot take it."""
        shape = PackedWeight.packed_shape(weight)
        if shape is None:
            return None
        n, k = weight.shape
        weight = weight.detach().contiguous()
        data = torch.empty(shape, dtype=torch.float32) if out is None else out.view(shape)
        if _lib().pack_weight(weight.data_ptr(), data.data_ptr(), n, k) != 0:
            return None
        return PackedWeight(data, n, k)


def linear(x: torch.Tensor, packed: PackedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] float32 -> x @ weight.T + bias, [M, N] float32."""
    library = _lib()
    if library is None:
        raise RuntimeError("no packed float32 kernel at this ISA level (build.reset() since the weight was packed?)")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != packed.in_features:
        raise ValueError(f"x must be float32 [M, {packed.in_features}], got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], packed.out_features, dtype=torch.float32)
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
    status = library.f32_gemm(x.data_ptr(), packed.data.data_ptr(), bias.data_ptr() if bias is not None else None,
                              y.data_ptr(), x.shape[0], packed.out_features, packed.in_features,
                              torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"f32_gemm failed (status {status})")
    return y
