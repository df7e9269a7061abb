"""GGUF weights kept quantized: a tensor's raw blocks -> the quantized matmul's codes, scales and offsets.

Q8_0 becomes kind 8 (w = d * q); Q4_0, Q4_1 and Q4_K become kind 4 (w = d * q + m, q in 0..15, per group of
32 along the input dimension: Q4_0's m is -8d, Q4_K's 32-value sub-blocks carry d * scale and -dmin * min);
Q6_K becomes kind 6 (w = d * scale * (q - 32), q in 0..63, per 16-value sub-block). The values are exactly
those loader/gguf_quants.py dequantizes to (every product of a code and a scale is exact in float32, so
d * q + (-8d) is (q - 8) * d; Q6_K's d * scale is computed first, as there), so the kernel computes with the
weights the float path would have loaded. Other types are dequantized on load.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from pagedserve.kernels.quant_gemm import SuperScales
from pagedserve.loader.gguf_quants import _half, _nibbles, q4_k_factors, q6_k_factors
from pagedserve.quantization.quantized_tensor import QuantizedTensor

KEPT_TYPES = frozenset({QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q6_K})


def from_gguf(name: str, raw: np.ndarray, qtype: QType, shape: tuple[int, int]) -> QuantizedTensor:
    """One GGUF tensor (raw data, numpy-order shape [N, K]) as codes/scales/offsets."""
    if qtype not in KEPT_TYPES:
        raise ValueError(f"GGUF type {qtype.name} is not kept quantized (kept: {', '.join(sorted(t.name for t in KEPT_TYPES))})")
    n, k = shape
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8)).reshape(-1, type_size)
    if qtype == QType.Q8_0:
        codes, scales, offsets, kind = blocks[:, 2:].clone(), _half(blocks, 0), None, 8
    elif qtype in (QType.Q4_0, QType.Q4_1):
        codes = _nibbles(blocks[:, 2 if qtype == QType.Q4_0 else 4:])
        scales = _half(blocks, 0)
        offsets = -8.0 * scales if qtype == QType.Q4_0 else _half(blocks, 2)
        kind = 4
    elif qtype == QType.Q6_K:
        codes, scale_codes, d = q6_k_factors(blocks)
        scales = scale_codes.float() * d.float()  # as gguf_quants.q6_k_codes computes them
        factors = SuperScales(d.reshape(n, k // 256), scale_codes.reshape(n, k // 16))
        return QuantizedTensor(name, qtype, codes.reshape(n, k).contiguous(), scales.reshape(n, k // 16).contiguous(),
                               torch.zeros(n, k // 32), 6, super_scales=factors)
    else:
        return _from_q4_k(name, blocks, n, k)
    groups = k // 32
    scales = scales.reshape(n, groups).contiguous()
    offsets = torch.zeros_like(scales) if offsets is None else offsets.reshape(n, groups).contiguous()
    return QuantizedTensor(name, qtype, codes.reshape(n, k).contiguous(), scales, offsets, kind)


def _from_q4_k(name: str, blocks: torch.Tensor, n: int, k: int) -> QuantizedTensor:
    """Q4_K super-blocks of 256 as 8 groups of 32 each (the float loader's own split, gguf_quants.q4_k_groups),
    their 6-bit scales and mins kept with the super-blocks' factors."""
    codes, d, scale_codes, dmin, min_codes = q4_k_factors(blocks)
    scales, mins = d.float() * scale_codes.float(), dmin.float() * min_codes.float()
    factors = SuperScales(d.reshape(n, k // 256), scale_codes.reshape(n, k // 32), dmin.reshape(n, k // 256),
                          min_codes.reshape(n, k // 32))
    return QuantizedTensor(name, QType.Q4_K, codes.reshape(n, k).contiguous(),
                           scales.reshape(n, k // 32).contiguous(), (-mins).reshape(n, k // 32).contiguous(), 4,
                           super_scales=factors)
