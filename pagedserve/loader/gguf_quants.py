"""Dequantization of GGUF tensor blocks, in vectorised torch (the same numbers as gguf.quants, 2-3x faster)."""

from __future__ import annotations

from typing import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

# ---------------------------------------------------------------------------------------------
# Dequantization. Each function takes the raw blocks as a uint8 tensor [n_blocks, bytes_per_block]
# and returns float32 values [n_blocks, values_per_block], following ggml's reference layouts
# (ggml-quants.c, dequantize_row_*).
# ---------------------------------------------------------------------------------------------


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 stored at byte ``offset`` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Low nibbles of all bytes, then high nibbles: ggml packs value j and j + n/2 in byte j."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


# The common types work in place on their one float32 buffer: fewer temporaries keep the peak
# memory and the time spent first-touching fresh pages down.


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16, qs: 32 x int8; x = d * q
    return blocks[:, 2:].view(torch.int8).float().mul_(_half(blocks, 0))


def _dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16, qs: 16 bytes of 4-bit values; x = d * (q - 8)
    return _nibbles(blocks[:, 2:]).float().sub_(8.0).mul_(_half(blocks, 0))


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16, m: f16, qs: 16 bytes of 4-bit values; x = d * q + m
    return _nibbles(blocks[:, 4:]).float().mul_(_half(blocks, 0)).add_(_half(blocks, 2))


def q4_k_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks of 256 = 8 sub-blocks of 32 -> (codes [n, 8, 32] uint8 0..15, d * scale [n, 8],
    dmin * min [n, 8]); a value is d * scale * q - dmin * min."""
    codes, d, scales, dmin, mins = q4_k_factors(blocks)
    return codes, d.float() * scales.float(), dmin.float() * mins.float()


def q4_k_factors(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_K super-blocks -> (codes [n, 8, 32] uint8 0..15, d [n, 1] float16, scales [n, 8] uint8 0..63,
    dmin [n, 1] float16, mins [n, 8] uint8 0..63), as the block holds them.

    d, dmin: f16; scales: 12 bytes holding 8 six-bit scales and 8 six-bit mins; qs: 128 bytes, each 32-byte
    group holds two sub-blocks (low nibbles first)."""
    n = blocks.shape[0]
    d, dmin = blocks[:, 0:2].contiguous().view(torch.float16), blocks[:, 2:4].contiguous().view(torch.float16)
    s = blocks[:, 4:16]
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    # Sub-blocks 0-3 keep their 6 bits in bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take
    # 4 bits from bytes 8-11 and their top 2 bits from the unused top bits of bytes 0-7.
    scales = torch.cat([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], dim=1)
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    codes = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32)
    return codes, d, scales, dmin, mins


def _dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    codes, scales, mins = q4_k_groups(blocks)
    out = scales.unsqueeze(-1) * codes.float() - mins.unsqueeze(-1)
    return out.reshape(blocks.shape[0], 256)


def q6_k_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks of 256 = 16 sub-blocks of 16 -> (codes [n, 256] uint8 0..63, d * scale [n, 16]); a
    value is d * scale * (q - 32)."""
    codes, scales, d = q6_k_factors(blocks)
    return codes, scales.float() * d.float()


def q6_k_factors(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks -> (codes [n, 256] uint8 0..63, scales [n, 16] int8, d [n, 1] float16), as held.

    ql: 128 bytes (low 4 bits), qh: 64 bytes (high 2 bits), scales: 16 x int8, d: f16. Each half of 128 values
    takes 64 ql bytes (low nibbles: values 0-63, high nibbles: 64-127) and 32 qh bytes (2-bit fields at shifts
    0, 2, 4, 6 for values 0-31, 32-63, 64-95, 96-127)."""
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, :128].reshape(n, 2, 64))
    qh = blocks[:, 128:192].reshape(n, 2, 32)
    qh = torch.cat([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], dim=-1)
    codes = (ql | (qh << 4)).reshape(n, 256)
    return codes, blocks[:, 192:208].contiguous().view(torch.int8), blocks[:, 208:210].contiguous().view(torch.float16)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    codes, scales = q6_k_codes(blocks)
    q = codes.float() - 32.0
    return (q.reshape(-1, 16, 16) * scales.unsqueeze(-1)).reshape(-1, 256)


_BLOCK_DEQUANTIZERS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.Q8_0: _dequantize_q8_0,
    QType.Q4_0: _dequantize_q4_0,
    QType.Q4_1: _dequantize_q4_1,
    QType.Q4_K: _dequantize_q4_k,
    QType.Q6_K: _dequantize_q6_k,
}
_FLOAT_TYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}
SUPPORTED_TENSOR_TYPES = frozenset(_FLOAT_TYPES) | frozenset(_BLOCK_DEQUANTIZERS)


def dequantize(
    raw: np.ndarray, qtype: QType, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode one GGUF tensor's data to a new ``dtype`` tensor of ``shape``.

    ``raw`` is the tensor's data as GGUFFile (or GGUFReader) gives it (any dtype; only its bytes are read), and
    ``shape`` the logical shape in numpy order (GGUF lists dimensions innermost first, so this is
    the reverse of ReaderTensor.shape). The result never shares memory with ``raw``.
    """
    if qtype not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(f"unsupported GGUF tensor type {qtype.name}")
    data = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8))
    if qtype in _FLOAT_TYPES:
        # copy=True: never hand out a view of the (memory-mapped) file.
        return data.view(_FLOAT_TYPES[qtype]).reshape(shape).to(dtype, copy=True)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    values = _BLOCK_DEQUANTIZERS[qtype](data.reshape(-1, type_size))
    return values.reshape(shape).to(dtype)
