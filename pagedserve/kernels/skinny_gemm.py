"""bfloat16 linear layers for small batches (csrc/skinny_gemm.c): weights laid out once for the CPU's vector
unit, so that a decode step with few sequences streams each weight once instead of having the BLAS re-lay it
out on every call (about 3x faster at 16 rows here, see docs/benchmarks.md).

Paths by ISA level (kernels/build.py): avx512_bf16 uses AVX-512 BF16 dot products on [N/16, K/2, 16, 2]
weights; avx512 (no BF16) and avx2 widen bf16 to fp32 and use AVX2 FMAs on [N/16, K, 8, 2] weights; generic
has no path (PackedWeight.of returns None and layers use torch). Every path sums each output in fp32 in k
order and rounds once to bf16, so a row's result does not depend on how many rows are in the batch.

`PackedWeight.of(weight)` packs a [N, K] bf16 weight (None where the kernel cannot run: generic level, no
compiler, other dtypes or shapes); `linear(x, packed, bias)` computes x @ weight.T + bias for x [M, K].
Layers use it for M <= MAX_ROWS and torch above, where the BLAS is at full speed; at the avx512_bf16 level it
takes every batch (takes_every_batch), unless the CPU has AMX-BF16 and torch's oneDNN, computing on AMX tiles,
measures faster on large batches at load (LARGE_BATCH_ENV).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pagedserve.kernels import build
from pagedserve.kernels.build import load_library

logger = logging.getLogger(__name__)

MAX_ROWS = 32
"""Where the packed kernel does not take every batch (takes_every_batch()), layers use it up to this many rows and
torch above. The AVX-512 BF16 path (passes of 12 rows over 2 column blocks) is ahead of torch's BLAS at every row
count measured (1 to 2048 rows: 2.6x at 1, 1.5x at 32, 1.02x at 256, 1.14x at 1024 on the default model's
shapes), so there layers hold only the packed copy and use it for every batch. Before that (one column block of
16 rows a pass), up to this many rows the packed kernel beat torch's bf16 matmul here (measured: 2.9x at 1 row, 1.5x at
16, 1.15x at 32, even at 64); above, torch's BLAS is as fast or faster. The AVX2 path against torch held to
AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2, on this Zen 4, 2 threads, noisy shared machine):
1.1-1.6x at 1 row, 3.6-4.2x at 16, 4.4-4.7x at 32 (benchmarks/small_batch_matmul.py)."""

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_LAYOUTS = {1: lambda n, k: (n // 16, k // 2, 16, 2), 2: lambda n, k: (n // 16, k, 8, 2)}
"""The C file's packed layouts (packed_layout()): 1 AVX-512 BF16, 2 AVX2."""


def _lib() -> Optional[ctypes.CDLL]:
    """The library for the ISA level in force (build.py caches it per process), or None without a path."""
    library = load_library("skinny_gemm")
    if library is None:
        return None
    if getattr(library, "_layout", None) is None:
        library.pack_weight.argtypes = [_P, _P, _I64, _I64]
        library.packed_rows.argtypes = [_P, _P, _I64, _P, _I64, _I64]
        library.packed_rows.restype = _INT
        library.skinny_gemm.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, _INT]
        library.skinny_gemm_accumulate.argtypes = [_P, _P, _P, _I64, _I64, _I64, _INT]
        library.skinny_gemm_swiglu.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, _INT]
        library.pack_weight.restype = library.skinny_gemm.restype = library.skinny_gemm_accumulate.restype = _INT
        library.skinny_gemm_swiglu.restype = library.fuses_swiglu.restype = _INT
        library._layout = library.packed_layout() if library.available() else 0
    return library if library._layout else None


@dataclass(frozen=True)
class PackedWeight:
    data: torch.Tensor
    """bf16, [N / 16, K / 2, 16, 2] (avx512_bf16) or [N / 16, K, 8, 2] (avx2, avx512): the library's layout."""
    out_features: int
    in_features: int

    @staticmethod
    def packed_shape(weight: torch.Tensor) -> Optional[tuple[int, ...]]:
        """The packed layout's shape for this weight, or None where the kernel cannot take it."""
        n, k = weight.shape
        if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or n % 16 or k % 2
                or _lib() is None):
            return None
        return _LAYOUTS[_lib()._layout](n, k)

    @staticmethod
    def of(weight: torch.Tensor, out: Optional[torch.Tensor] = None) -> Optional["PackedWeight"]:
        """Pack `weight` (into `out`, a bf16 tensor of packed_shape's size, when given); None where the kernel
        cannot take it."""
        shape = PackedWeight.packed_shape(weight)
        if shape is None:
            return None
        n, k = weight.shape
        weight = weight.detach().contiguous()
        data = torch.empty(shape, dtype=torch.bfloat16) if out is None else out.view(shape)
        if _lib().pack_weight(weight.data_ptr(), data.data_ptr(), n, k) != 0:
            return None
        return PackedWeight(data, n, k)


LARGE_BATCH_ENV = "PAGEDSERVE_BF16_LARGE_BATCH"
"""Who computes bf16 matmuls of more than MAX_ROWS rows at the avx512_bf16 level: `packed` (this kernel, every
batch), `torch` (torch's BLAS: oneDNN, with AMX tiles where the CPU has them) or `auto` (the default): packed,
unless the CPU has AMX-BF16 and torch measures at least TORCH_MARGIN times faster on a large batch at load."""
LARGE_BATCH_CHOICES = ("auto", "packed", "torch")
TORCH_MARGIN = 1.25
"""How much faster torch must measure before `auto` gives it the large batches: a margin well above this VM's
noise, so that the choice (and with it which rows are batch-invariant) does not flip between runs."""

_MEASURED_SHAPE = (256, 1536, 576)  # rows, out, in: a decode step of 256 sequences through an MLP-sized linear


def takes_every_batch() -> bool:
    """Whether the packed kernel in force takes every batch (the AVX-512 BF16 layout, ahead of torch at any number
    of rows without AMX), so that a layer can hold its weight only packed. See LARGE_BATCH_ENV."""
    library = _lib()
    if library is None or library._layout != 1:
        return False
    if getattr(library, "_every_batch", None) is None:  # decided once per library (build.reset() forgets it)
        library._every_batch = large_batches_packed(os.environ.get(LARGE_BATCH_ENV) or "auto",
                                                    build.cpu_flags(), measure_large_batch)
    return library._every_batch


def large_batches_packed(choice: str, cpu_flags: list[str],
                         measure: Callable[[], tuple[float, float]]) -> bool:
    """Whether the packed kernel keeps batches above MAX_ROWS for `choice` (a LARGE_BATCH_ENV value) on a CPU with
    `cpu_flags`; `measure` -> (packed seconds, torch seconds) is called only for `auto` on an AMX-BF16 CPU."""
    if choice not in LARGE_BATCH_CHOICES:
        raise ValueError(f"{LARGE_BATCH_ENV}={choice!r} is not one of {', '.join(LARGE_BATCH_CHOICES)}")
    if choice != "auto":
        return choice == "packed"
    if "amx_bf16" not in cpu_flags:
        return True
    packed_s, torch_s = measure()
    packed = torch_s * TORCH_MARGIN > packed_s
    logger.info("bf16 matmul of %d x %d x %d on this AMX-BF16 CPU: packed kernel %.2f ms, torch (oneDNN) %.2f ms: "
                "%s computes batches of more than %d rows", *_MEASURED_SHAPE, packed_s * 1e3, torch_s * 1e3,
                "the packed kernel" if packed else "torch", MAX_ROWS)
    return packed


def measure_large_batch(repeats: int = 5) -> tuple[float, float]:
    """Best-of-`repeats` seconds of one [rows, in] x [in, out] bf16 matmul (_MEASURED_SHAPE) through the packed
    kernel and through torch, alternating, after one warm-up call each (oneDNN builds its kernel on the first)."""
    rows, out_features, in_features = _MEASURED_SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    packed = PackedWeight.of(weight)
    runs = {"packed": lambda: linear(x, packed), "torch": lambda: torch.nn.functional.linear(x, weight)}
    best = {name: float("inf") for name in runs}
    for repeat in range(repeats + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if repeat:  # the first round warms up
                best[name] = min(best[name], time.perf_counter() - start)
    return best["packed"], best["torch"]


def _library_for(packed: PackedWeight) -> ctypes.CDLL:
    library = _lib()
    if library is None or packed.data.shape[2] != (16 if library._layout == 1 else 8):
        raise RuntimeError("weight packed for another ISA level (build.reset() since it was packed?)")
    return library


def linear(x: torch.Tensor, packed: PackedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] bf16 (fp32 sums, rounded once, bias added before rounding)."""
    return _call("skinny_gemm", x, packed, bias, packed.out_features)


def _call(name: str, x: torch.Tensor, packed: PackedWeight, bias: Optional[torch.Tensor],
          out_width: int) -> torch.Tensor:
    """The library's `name` (skinny_gemm's signature) on x and packed -> a new [M, out_width] bf16 tensor."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_width, dtype=torch.bfloat16)
    if bias is not None:
        bias = bias.detach().contiguous()
    status = getattr(_library_for(packed), name)(
        x.data_ptr(), packed.data.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
        x.shape[0], packed.out_features, packed.in_features, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"{name} failed (status {status})")
    return y


def fuses_swiglu(packed: PackedWeight) -> bool:
    """Whether `linear_swiglu` takes this packed fused gate/up weight (the AVX-512 BF16 layout, whole column
    blocks in each half)."""
    library = _lib()
    return library is not None and bool(library.fuses_swiglu()) and packed.out_features % 32 == 0


def linear_swiglu(x: torch.Tensor, packed: PackedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] bf16 and a fused gate/up weight [2 * D, K] (gate first) -> silu(gate) * up [M, D] bf16, bit for bit
    what `linear` then fused_ops.swiglu give, without storing the [M, 2 * D] projection. Requires fuses_swiglu."""
    return _call("skinny_gemm_swiglu", x, packed, bias, packed.out_features // 2)


def linear_accumulate(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor) -> None:
    """out [M, N] += x [M, K] @ weight.T, in place (bf16; out's values join the fp32 sums, rounded once).
    `out` must be contiguous (a run of rows of a contiguous tensor is)."""
    if not out.is_contiguous() or out.dtype != torch.bfloat16 or tuple(out.shape) != (x.shape[0], packed.out_features):
        raise ValueError(f"out must be a contiguous bf16 [{x.shape[0]}, {packed.out_features}] tensor")
    x = x.contiguous()
    status = _library_for(packed).skinny_gemm_accumulate(x.data_ptr(), packed.data.data_ptr(), out.data_ptr(),
                                                         x.shape[0], packed.out_features, packed.in_features,
                                                         torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"skinny_gemm_accumulate failed (status {status})")


def rows(ids: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """Rows `ids` (any shape, int) of the packed [N, K] weight used as a lookup table -> [*ids.shape, K] bf16, the
    weight's values exactly (a tied LM head held only packed still serves the token embeddings). An id outside
    0..N-1 is an IndexError."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), packed.in_features, dtype=torch.bfloat16)
    status = _library_for(packed).packed_rows(packed.data.data_ptr(), flat.data_ptr(), flat.numel(), out.data_ptr(),
                                              packed.out_features, packed.in_features)
    if status == 3:
        raise IndexError(f"index out of range: ids must lie in 0..{packed.out_features - 1}")
    if status != 0:
        raise RuntimeError(f"skinny_gemm packed_rows failed (status {status})")
    return out.view(*ids.shape, packed.in_features)
