"""8-bit KV cache: which dtypes there are, and the reference quantize/dequantize in torch.

Each (token, kv head) of K and of V is stored as head_dim 8-bit codes plus one bfloat16 scale (per token
rather than per block: a block is written a token at a time, so a per-block scale would either be guessed
from its first token or force earlier tokens to be requantized):

    scale = bf16(amax / QMAX), or 1 where that is 0;   code = round(clamp(x / scale, -QMAX, QMAX))
    value = code * scale   (exact in float32)

QMAX is 127 for int8 (round half to even), 448 for fp8 e4m3 and 57344 for fp8 e5m2 (round to nearest even,
as torch casts). The C write kernel (kernels/csrc/kv_quant.h) rounds exactly as these functions do, and the
decode kernel dequantizes each element to `code * scale` in float32 before it uses it, so attention over a
quantized cache equals attention over a float32 cache holding these values.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedserve.config import KV_CACHE_DTYPES  # auto (the model dtype), vLLM's names, int8; fp8 = fp8_e4m3

_STORAGE = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
            "int8": torch.int8}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_DTYPE = torch.bfloat16
QUANTIZED_DTYPES = tuple(QMAX)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of the cache tensors for a --kv-cache-dtype value."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _STORAGE:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return _STORAGE[kv_cache_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] (float) -> (codes [..., head_dim] of `dtype`, scales [...] bfloat16)."""
    qmax = QMAX[dtype]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / qmax).to(SCALE_DTYPE)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    scaled = (xf / scale.float().unsqueeze(-1)).clamp_(-qmax, qmax)
    codes = scaled.round_().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., head_dim] with scales [...] -> values [..., head_dim] (computed in float32)."""
    return (codes.float() * scale.float().unsqueeze(-1)).to(out_dtype)


def roundtrip(x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """x as a cache of `dtype` gives it back: float32 values for an 8-bit cache (x itself otherwise)."""
    if dtype is None or not is_quantized(dtype):
        return x
    return dequantize(*quantize(x, dtype))
