"""A decode step's decoder layers as one C call (csrc/decode_layers.c), for small batches in bfloat16 on CPU.

The C side calls the same kernels the Python layers call (fused_ops, skinny_gemm, cpu_decode), through
function pointers into their libraries, so the result is bit for bit that of the Python path; what goes away
is the Python between them (~300 module calls, allocations and ctypes conversions a step), which at a few
sequences took as long as the matmuls.

`DecodeLayers.build(model)` returns None unless every piece has its C path here (bf16 weights packed for the
small-batch matmul, the fused ops, the decode-attention kernel for these shapes). `runs(num_rows, meta)` says
whether a step qualifies: decodes only (one new token per sequence), at most skinny_gemm.MAX_ROWS of them.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from pagedserve.attention import cpu_decode
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.kernels import fused_ops, skinny_gemm
from pagedserve.kernels.build import load_library

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("rms_norm", "gemm", "rotary", "attention", "swiglu")]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up",
                                        "gate_up_bias", "down", "down_bias", "key_cache", "value_cache")]


class _Shape(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                          "block_size")] + [("eps", _F), ("scale", _F)]


class _Step(ctypes.Structure):
    _fields_ = ([("rows", _I64), ("max_blocks", _I64)]
                + [(name, _P) for name in ("positions", "slots", "block_tables", "context_lens", "cos_table",
                                           "sin_table", "hidden", "residual", "scratch")]
                + [("threads", ctypes.c_int)])


def _address(library: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(library, name), _P).value


def _ptr(tensor: Optional[torch.Tensor]) -> Optional[int]:
    return None if tensor is None else tensor.data_ptr()


def _library() -> Optional[ctypes.CDLL]:
    library = load_library("decode_layers")
    if library is not None and getattr(library, "_typed", None) is None:
        library.decode_layers.argtypes = [_P, _P, _I64, _P, _P]
        library.decode_layers.restype = ctypes.c_int
        library.scratch_elements.argtypes = [_P, _I64]
        library.scratch_elements.restype = _I64
        library._typed = True
    return library


class DecodeLayers:
    def __init__(self, library: ctypes.CDLL, kernels: _Kernels, layers, shape: _Shape, model) -> None:
        self._library, self._kernels, self._layers, self._shape = library, kernels, layers, shape
        self._model = model  # keeps the weights and caches the pointers point into alive
        scratch = library.scratch_elements(ctypes.byref(shape), skinny_gemm.MAX_ROWS)
        self._scratch = torch.empty(scratch, dtype=torch.bfloat16)

    @staticmethod
    def build(model) -> Optional["DecodeLayers"]:
        """For a LlamaForCausalLM whose KV caches are bound and whose linears are packed; None where any
        piece lacks its C path."""
        layers = model.model.layers
        attn = layers[0].self_attn
        probe = torch.empty(1, attn.q_size, dtype=torch.bfloat16)
        if (attn.key_cache is None or attn.key_cache.dtype != torch.bfloat16 or not fused_ops.fuses_swiglu(probe)
                or not fused_ops.fuses_rotary(probe)
                or not cpu_decode.supports(probe.view(1, attn.num_heads, attn.head_dim), attn.key_cache)
                or any(lin.packed is None for layer in layers for lin in (
                    layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))):
            return None
        library = _library()
        if library is None:
            return None
        ops, gemm, attention = fused_ops._lib(), skinny_gemm._lib(), cpu_decode.load()
        kernels = _Kernels(_address(ops, "rms_norm"), _address(gemm, "skinny_gemm"),
                           _address(ops, "rotary_and_cache"), _address(attention, "decode_attention_bf16"),
                           _address(ops, "swiglu"))
        table = (_Layer * len(layers))(*[_layer_struct(layer) for layer in layers])
        shape = _Shape(model.config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                       layers[0].mlp.down_proj.in_features, attn.value_cache.shape[2],
                       layers[0].input_layernorm.eps, attn.head_dim ** -0.5)
        return DecodeLayers(library, kernels, table, shape, model)

    @staticmethod
    def runs(num_rows: int, meta: AttentionMetadata) -> bool:
        return (num_rows <= skinny_gemm.MAX_ROWS and meta.decode is not None and not meta.prefills
                and meta.decode.num_seqs == num_rows)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [rows, hidden] (the embeddings; overwritten) -> (last layer's output, residual stream)."""
        rows = hidden.shape[0]
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        decode = meta.decode
        step = _Step(rows, decode.block_tables.shape[1], positions.data_ptr(), meta.slot_mapping.data_ptr(),
                     decode.block_tables.data_ptr(), decode.context_lens.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                     hidden.data_ptr(), residual.data_ptr(), self._scratch.data_ptr(), torch.get_num_threads())
        status = self._library.decode_layers(ctypes.byref(self._kernels), self._layers, len(self._layers),
                                             ctypes.byref(self._shape), ctypes.byref(step))
        if status != 0:
            raise RuntimeError(f"decode_layers failed in layer {status // 100 - 1} (kernel status {status % 100})")
        return hidden, residual


def _layer_struct(layer) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    return _Layer(_ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight),
                  _ptr(attn.qkv_proj.packed.data), _ptr(attn.qkv_proj.bias), _ptr(attn.o_proj.packed.data),
                  _ptr(attn.o_proj.bias), _ptr(mlp.gate_up_proj.packed.data), _ptr(mlp.gate_up_proj.bias),
                  _ptr(mlp.down_proj.packed.data), _ptr(mlp.down_proj.bias), _ptr(attn.key_cache),
                  _ptr(attn.value_cache))
