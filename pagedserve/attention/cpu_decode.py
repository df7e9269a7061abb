"""The C decode-attention kernel (kernels/csrc/decode_attention.c), built by `pagedserve.kernels.build`.

Paths by ISA level (kernels/build.py; the level is chosen at run time from the CPU flags, or forced lower
with PAGEDSERVE_CPU_ISA):
- avx512_bf16, avx512: AVX-512 for head_dim 64/128 and block_size % 16 == 0, 16 tokens a vector (in bf16,
  AVX-512 BF16 dot products when the CPU has them, else widening by shifts and fp32 FMAs);
- avx2: AVX2 + FMA for head_dim 64/128 and block_size % 8 == 0, 8 tokens a vector, bf16 widened by shifts;
- every level, and other shapes: a plain C loop that gcc vectorizes for the level.
All read the cache in place (attention/kv_layout.py) and accumulate in float32. Caches are float32, bf16 (with
a query of the same dtype), or 8-bit (int8, float8 e4m3/e5m2 with per-token scales, for either query dtype).

If it cannot be built, `load()` returns None and attention falls back to the torch path;
PAGEDSERVE_CPU_KERNEL=0 turns it off.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from pagedserve.kernels.build import load_library

_QUERY_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_CACHE_NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
_FUNCTIONS = {(q, q): f"decode_attention_{name}" for q, name in _QUERY_NAMES.items()}
_FUNCTIONS.update({(q, c): f"decode_attention_{qn}_{cn}" for q, qn in _QUERY_NAMES.items()
                   for c, cn in _CACHE_NAMES.items()})
"""(query dtype, cache element dtype) -> entry point."""
_ARGTYPES = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
# Reassociation lets gcc vectorize the dot products; attention has no exact reference order to keep.
_EXTRA_FLAGS = ("-fassociative-math", "-fno-signed-zeros")


def load() -> Optional[ctypes.CDLL]:
    """The compiled kernel library, or None when it cannot be built here."""
    library = load_library("decode_attention", _EXTRA_FLAGS)
    if library is not None and getattr(library, "_typed", None) is None:
        for name in _FUNCTIONS.values():
            getattr(library, name).argtypes = _ARGTYPES
            getattr(library, name).restype = ctypes.c_int
        library._typed = True
    return library


_MAX_GROUP, _MAX_HEAD_DIM, _MAX_BLOCK = 16, 256, 64  # the C file's MAX_* limits


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the kernel handles this case; otherwise the caller uses the torch path.
    key_cache: [num_blocks, kv_heads, head_dim // pack, block_size, pack] (attention/kv_layout.py)."""
    _, num_heads, head_dim = query.shape
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[3]
    return (query.device.type == "cpu" and (query.dtype, key_cache.dtype) in _FUNCTIONS
            and num_heads % kv_heads == 0 and num_heads // kv_heads <= _MAX_GROUP
            and head_dim <= _MAX_HEAD_DIM and block_size <= _MAX_BLOCK and load() is not None)


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """query [B, H, D] -> [B, H * D]; block_tables [B, max_blocks] int64, context_lens [B] int64. An 8-bit
    cache needs its (key, value) scales [num_blocks, kv_heads, block_size] bf16 (quantization/kv_cache.py)."""
    batch, num_heads, head_dim = query.shape
    _, kv_heads, block_size, _ = value_cache.shape
    if (kv_scales is None) == (key_cache.dtype in _CACHE_NAMES):
        raise ValueError(f"a {key_cache.dtype} cache {'needs' if kv_scales is None else 'has no'} scales")
    key_scale, value_scale = (s.data_ptr() for s in kv_scales) if kv_scales else (None, None)
    query = query.contiguous()
    out = torch.empty(batch, num_heads * head_dim, dtype=query.dtype)
    status = getattr(load(), function_name(query.dtype, key_cache.dtype))(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), key_scale, value_scale,
        block_tables.data_ptr(), context_lens.data_ptr(), out.data_ptr(), batch, num_heads, kv_heads, head_dim,
        block_size, block_tables.shape[1], head_dim ** -0.5, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"decode attention kernel failed (status {status}; heads {num_heads}/{kv_heads}, "
                           f"head_dim {head_dim})")
    return out


def function_name(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    """The C entry point for a query dtype and a cache element dtype."""
    return _FUNCTIONS[(query_dtype, cache_dtype)]
