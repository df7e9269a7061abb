"""Fused elementwise ops of a Llama layer (csrc/fused_ops.c): RMSNorm with the residual add, rotary
embedding with the KV-cache write, and SwiGLU. Each is one pass instead of several torch ops and temporaries,
with the reference's rounding kept (see the C file). The layers ask `fuses_norm(x)` / `fuses_rotary(x)` and
fall back to their torch code where the answer is False (no compiler, CUDA, float16).

In bfloat16 both match the torch reference bit for bit. In float32 only the rotary kernel does: the norm's
sum of squares rounds differently from torch's vectorized reduction in the last bit, so float32 keeps the
torch norm (float32 is the dtype that the exactness tests pin to transformers). SwiGLU is used in bfloat16
only: its exp is not torch's, so a result may differ from torch's by one bf16 rounding step (and in float32
it would break the token-for-token match with transformers).

The C file is plain C (no intrinsics): one path, auto-vectorized by gcc for the ISA level in force
(kernels/build.py: avx512_bf16, avx512, avx2 or generic), and bit-exact at every level."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from pagedserve.kernels.build import load_library

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
"""Cache element dtype -> the C kernels' kind code (csrc/kv_quant.h)."""
_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "rms_norm": [_P, _P, _P, _P, _I64, _I64, _F, _INT, _INT],
    "rotary_and_cache": [_P, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT, _INT, _INT],
    "swiglu": [_P, _P, _I64, _I64, _INT, _INT],
    "argmax_bf16": [_P, _I64, _I64, _P, _INT],
}
# Rounding must happen where the reference rounds: no fusing of a rounded multiply into an add.
_EXTRA_FLAGS = ("-ffp-contract=off",)


def _lib() -> Optional[ctypes.CDLL]:
    """The library for the ISA level in force (build.py caches it per process), or None."""
    library = load_library("fused_ops", _EXTRA_FLAGS)
    if library is not None and getattr(library, "_typed", None) is None:
        for name, argtypes in _SIGNATURES.items():
            getattr(library, name).argtypes = argtypes
            getattr(library, name).restype = _INT
        library._typed = True
    return library


def fuses_rotary(x: torch.Tensor) -> bool:
    """Whether `rotary_and_cache` handles tensors like x (CPU, float32 or bfloat16, and it builds here)."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and _lib() is not None


def fuses_norm(x: torch.Tensor) -> bool:
    """Whether `rms_norm` handles x exactly as the reference would (CPU bfloat16)."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and _lib() is not None


def fuses_swiglu(x: torch.Tensor) -> bool:
    """Whether `swiglu` takes over from torch's silu(gate) * up for x (CPU bfloat16)."""
    return fuses_norm(x)


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"fused kernel {name} failed (status {status})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm of x [rows, dim]; with `residual`, first residual += x (in place) and normalize residual."""
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, dim = x.shape
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype
    _check(_lib().rms_norm(x.data_ptr(), residual.data_ptr() if residual is not None else None,
                           weight.data_ptr(), out.data_ptr(), rows, dim, eps, _DTYPES[x.dtype],
                           torch.get_num_threads()), "rms_norm")
    return out


def rotary_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     num_heads: int, num_kv_heads: int, head_dim: int,
                     kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    """Rotate the q and k heads of qkv [tokens, (heads + 2 kv_heads) * head_dim] in place by the float32
    cos/sin tables [max_positions, head_dim] at `positions`, then store k and v at `slot_mapping` in the
    caches (layouts: attention/kv_layout.py). An 8-bit cache (int8 / float8 elements) needs `kv_scales`,
    the (key, value) bf16 scale tensors [num_blocks, kv_heads, block_size], filled as the codes are written
    (quantization/kv_cache.py)."""
    assert qkv.is_contiguous() and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    kind = KV_KINDS[key_cache.dtype]
    assert key_cache.dtype == value_cache.dtype and (key_cache.dtype == qkv.dtype or kind >= 2)
    assert (kv_scales is not None) == (kind >= 2)
    key_scale, value_scale = (s.data_ptr() for s in kv_scales) if kv_scales else (None, None)
    tokens = qkv.shape[0]
    _check(_lib().rotary_and_cache(
        qkv.data_ptr(), qkv.shape[1], positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        key_cache.data_ptr(), value_cache.data_ptr(), key_scale, value_scale, slot_mapping.data_ptr(), tokens,
        num_heads, num_kv_heads, head_dim, value_cache.shape[2], kind, _DTYPES[qkv.dtype],
        torch.get_num_threads()), "rotary_and_cache")


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 * d] (gate first) -> [rows, d]."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    _check(_lib().swiglu(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, _DTYPES[gate_up.dtype],
                         torch.get_num_threads()), "swiglu")
    return out


def argmax(logits: torch.Tensor) -> Optional[torch.Tensor]:
    """The index of the first maximum of each row of CPU bf16 logits [rows, vocab], exactly what
    logits.max(dim=-1).indices gives (ties to the first, a NaN above every number), a few times faster; None
    where the kernel does not take the tensor (another dtype or device, no compiler)."""
    if (logits.device.type != "cpu" or logits.dtype != torch.bfloat16 or logits.dim() != 2 or logits.shape[1] == 0
            or _lib() is None):
        return None
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.long)
    _check(_lib().argmax_bf16(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(),
                              torch.get_num_threads()), "argmax_bf16")
    return out
