"""The C decode-attention kernel (csrc/decode_attention.c): built once with gcc, called through ctypes.

Built on first use into ~/.cache/pagedserve (keyed by the source and the CPU's flags, since it is compiled
for this CPU with -march=native). If there is no compiler or the build fails, `load()` returns None and
attention falls back to the torch path; PAGEDSERVE_CPU_KERNEL=0 turns the kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_FUNCTIONS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
_library: Optional[ctypes.CDLL] = None
_tried = False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build() -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))
    target = cache / f"decode_attention-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC", "gcc")
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build aside, then rename: safe under concurrency
        built = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(built, target)
    return target


def load() -> Optional[ctypes.CDLL]:
    """The compiled kernel library, or None when it cannot be built here (logged once)."""
    global _library, _tried
    if _tried:
        return _library
    _tried = True
    if os.environ.get("PAGEDSERVE_CPU_KERNEL", "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("CPU decode-attention kernel unavailable (%s); using the torch path", detail.strip()[:500])
        return None
    for name in _FUNCTIONS.values():
        getattr(library, name).argtypes = _ARGTYPES
        getattr(library, name).restype = ctypes.c_int
    _library = library
    return library


_MAX_GROUP, _MAX_HEAD_DIM, _MAX_BLOCK = 16, 256, 64  # the C file's MAX_* limits


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the kernel handles this case; otherwise the caller uses the torch path."""
    _, num_heads, head_dim = query.shape
    _, kv_heads, block_size, _ = key_cache.shape
    return (query.device.type == "cpu" and query.dtype in _FUNCTIONS and key_cache.dtype == query.dtype
            and num_heads % kv_heads == 0 and num_heads // kv_heads <= _MAX_GROUP
            and head_dim <= _MAX_HEAD_DIM and block_size <= _MAX_BLOCK and load() is not None)


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """query [B, H, D] -> [B, H * D]; block_tables [B, max_blocks] int64, context_lens [B] int64."""
    batch, num_heads, head_dim = query.shape
    _, kv_heads, block_size, _ = key_cache.shape
    query = query.contiguous()
    out = torch.empty(batch, num_heads * head_dim, dtype=query.dtype)
    status = getattr(load(), _FUNCTIONS[query.dtype])(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), out.data_ptr(), batch, num_heads, kv_heads, head_dim, block_size,
        block_tables.shape[1], head_dim ** -0.5, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"decode attention kernel failed (status {status}; heads {num_heads}/{kv_heads}, "
                           f"head_dim {head_dim})")
    return out
