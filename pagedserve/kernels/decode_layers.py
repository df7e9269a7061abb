"""A decode step's decoder layers as one C call (csrc/decode_layers.c), for small batches in bfloat16 on CPU.

The C side calls the same kernels the Python layers call (fused_ops, skinny_gemm, cpu_decode), through
function pointers into their libraries, so the result is bit for bit that of the Python path; what goes away
is the Python between them (~300 module calls, allocations and ctypes conversions a step), which at a few
sequences took as long as the matmuls.

`DecodeLayers.build(model)` returns None unless every piece has its C path here (a bf16 model whose linear
weights are packed for the small-batch matmul or kept block-quantized for quant_gemm, the fused ops, the
decode-attention kernel for these shapes; a bf16 or 8-bit KV cache). `runs(num_rows, meta, lora_mapping)` says
whether a step qualifies: decodes only (one new token per sequence), at most skinny_gemm.MAX_ROWS of them, or
any number where every linear computes every batch with the kernel the C loop calls (held only packed, on the
AVX-512 BF16 level, or kept quantized) and no row has an adapter: then W1's 256-sequence steps run here too
(measured ~3 ms of Python a step at 32 rows).

With LoRA slots on the linears (lora/layers.py, packed for the same kernel), steps with adapter rows run here
too (`takes_lora()`): the C loop adds each run's delta after each matmul, as LinearLoRA.add_delta does, with
the same kernels, so those steps are also bit for bit the Python path's.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from pagedserve.attention import cpu_decode
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.kernels import fused_ops, quant_gemm, skinny_gemm
from pagedserve.kernels.build import load_library
from pagedserve.quantization import kv_cache as kv_quant

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("rms_norm", "gemm", "gemm_accumulate", "rotary", "attention", "swiglu",
                                        "quant_gemm", "gemm_swiglu")]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up",
                                        "gate_up_bias", "down", "down_bias", "key_cache", "value_cache",
                                        "key_scale", "value_scale")] + [("kinds", _I64 * 4), ("orders", _P * 4)]


class _Shape(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                          "block_size", "kv_kind")] + [("eps", _F), ("scale", _F)]


class _LinearLoRA(ctypes.Structure):
    _fields_ = [("a", _P), ("b", _P), ("widths", _P), ("a_stride", _I64), ("b_stride", _I64)]


class _LayerLoRA(ctypes.Structure):
    _fields_ = [(name, _LinearLoRA) for name in ("qkv", "o", "gate_up", "down")]


class _LoRAGroup(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("slot", "start", "stop")]


class _Step(ctypes.Structure):
    _fields_ = ([("rows", _I64), ("max_blocks", _I64)]
                + [(name, _P) for name in ("positions", "slots", "block_tables", "context_lens", "cos_table",
                                           "sin_table", "hidden", "residual", "scratch", "lora", "groups")]
                + [("num_groups", _I64), ("lora_scratch", _P), ("threads", ctypes.c_int)])


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
        self._scratch = torch.empty(0, dtype=torch.bfloat16)
        self._scratch_rows = 0
        self._lora: Optional[tuple] = None  # (per-layer table, shrink scratch), built on the first LoRA step
        self._any_rows = all(lin.quantized is not None or lin.held_packed_only
                             for layer in model.model.layers for lin in _linears(layer))
        """Whether the Python layers compute every batch size with the kernels this loop calls (so that the loop
        gives their result bit for bit at any number of rows), not torch's BLAS above MAX_ROWS."""

    @staticmethod
    def build(model) -> Optional["DecodeLayers"]:
        """For a LlamaForCausalLM whose KV caches are bound and whose linears are packed; None where any
        piece lacks its C path."""
        layers = model.model.layers
        attn = layers[0].self_attn
        probe = torch.empty(1, attn.q_size, dtype=torch.bfloat16)
        if (model.model.embed_tokens.weight.dtype != torch.bfloat16 or skinny_gemm._lib() is None
                or attn.key_cache is None
                or not _takes_cache(attn.key_cache.dtype) or not fused_ops.fuses_swiglu(probe)
                or not fused_ops.fuses_rotary(probe)
                or not cpu_decode.supports(probe.view(1, attn.num_heads, attn.head_dim), attn.key_cache)
                or any(lin.packed is None and lin.quantized is None for layer in layers for lin in _linears(layer))
                or (any(lin.quantized is not None for layer in layers for lin in _linears(layer))
                    and not quant_gemm.available())):
            return None
        library = _library()
        if library is None:
            return None
        ops, gemm, attention, quantized = fused_ops._lib(), skinny_gemm._lib(), cpu_decode.load(), quant_gemm._lib()
        gate_up = layers[0].mlp.gate_up_proj.packed  # the C loop ends bf16 gate/up matmuls in SwiGLU where it can
        gate_up_swiglu = gate_up is not None and skinny_gemm.fuses_swiglu(gate_up)
        kernels = _Kernels(_address(ops, "rms_norm"), _address(gemm, "skinny_gemm"),
                           _address(gemm, "skinny_gemm_accumulate"), _address(ops, "rotary_and_cache"),
                           _address(attention, cpu_decode.function_name(torch.bfloat16, attn.key_cache.dtype)),
                           _address(ops, "swiglu"), _address(quantized, "quant_gemm") if quantized else None,
                           _address(gemm, "skinny_gemm_swiglu") if gate_up_swiglu else None)
        table = (_Layer * len(layers))(*[_layer_struct(layer) for layer in layers])
        shape = _Shape(model.config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                       layers[0].mlp.down_proj.in_features, attn.value_cache.shape[2],
                       fused_ops.KV_KINDS[attn.key_cache.dtype], layers[0].input_layernorm.eps, attn.head_dim ** -0.5)
        return DecodeLayers(library, kernels, table, shape, model)

    def runs(self, num_rows: int, meta: AttentionMetadata, lora_mapping=None) -> bool:
        """Whether a step of num_rows tokens runs here: decodes only, and at most MAX_ROWS of them unless every
        linear takes any batch with this loop's kernels (LoRA rows: at most MAX_ROWS, and takes_lora())."""
        small = num_rows <= skinny_gemm.MAX_ROWS
        return ((small or (self._any_rows and lora_mapping is None)) and meta.decode is not None
                and not meta.prefills and meta.decode.num_seqs == num_rows
                and (lora_mapping is None or self.takes_lora()))

    def takes_lora(self) -> bool:
        """Whether steps with LoRA rows can run here: every linear of every layer has LoRA slots packed for
        the small-batch kernel."""
        if self._lora is None:
            slots = [[layer.self_attn.qkv_proj.lora, layer.self_attn.o_proj.lora, layer.mlp.gate_up_proj.lora,
                      layer.mlp.down_proj.lora] for layer in self._model.model.layers]
            if any(lora is None or lora.packed_a is None for per_layer in slots for lora in per_layer):
                return False
            table = (_LayerLoRA * len(slots))(*[_LayerLoRA(*map(_linear_lora, per_layer)) for per_layer in slots])
            widest = max(lora.a.shape[1] for per_layer in slots for lora in per_layer)
            self._lora = (table, torch.empty(skinny_gemm.MAX_ROWS * widest, dtype=torch.bfloat16), slots)
        return True

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, lora_mapping=None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [rows, hidden] (the embeddings; overwritten) -> (last layer's output, residual stream).
        With `lora_mapping` (a LoRAMapping; needs takes_lora()), its rows get their adapters' deltas."""
        rows = hidden.shape[0]
        if rows > self._scratch_rows:  # grown to the largest step seen (MAX_ROWS at least)
            self._scratch_rows = max(rows, skinny_gemm.MAX_ROWS)
            elements = self._library.scratch_elements(ctypes.byref(self._shape), self._scratch_rows)
            self._scratch = torch.empty(elements, dtype=torch.bfloat16)
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        decode = meta.decode
        table = groups = lora_scratch = None
        if lora_mapping is not None:
            if not self.takes_lora():
                raise RuntimeError("LoRA rows need LoRA slots packed for the small-batch kernel on every linear")
            table, shrink, _ = self._lora
            groups = (_LoRAGroup * len(lora_mapping.groups))(
                *[_LoRAGroup(slot, run.start, run.stop) for slot, run in lora_mapping.groups])
            table, lora_scratch = ctypes.addressof(table), shrink.data_ptr()
        step = _Step(rows, decode.block_tables.shape[1], positions.data_ptr(), meta.slot_mapping.data_ptr(),
                     decode.block_tables.data_ptr(), decode.context_lens.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                     hidden.data_ptr(), residual.data_ptr(), self._scratch.data_ptr(), table,
                     None if groups is None else ctypes.addressof(groups), 0 if groups is None else len(groups),
                     lora_scratch, torch.get_num_threads())
        status = self._library.decode_layers(ctypes.byref(self._kernels), self._layers, len(self._layers),
                                             ctypes.byref(self._shape), ctypes.byref(step))
        if status != 0:
            raise RuntimeError(f"decode_layers failed in layer {status // 100 - 1} (kernel status {status % 100})")
        return hidden, residual


def _linears(layer) -> tuple:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _weight(linear) -> tuple[Optional[int], int]:
    """(pointer, kind): the bf16 packed weight (kind 0) or the block-quantized one (its kind)."""
    if linear.quantized is not None:
        return linear.quantized.data.data_ptr(), linear.quantized.kernel_kind
    return linear.packed.data.data_ptr(), 0


def _layer_struct(layer) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    (qkv, qkv_kind), (o, o_kind), (gate_up, gate_up_kind), (down, down_kind) = map(_weight, _linears(layer))
    return _Layer(_ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight),
                  qkv, _ptr(attn.qkv_proj.bias), o, _ptr(attn.o_proj.bias), gate_up, _ptr(mlp.gate_up_proj.bias),
                  down, _ptr(mlp.down_proj.bias), _ptr(attn.key_cache), _ptr(attn.value_cache),
                  *(_ptr(s) for s in attn.kv_scales or (None, None)),
                  (_I64 * 4)(qkv_kind, o_kind, gate_up_kind, down_kind),
                  (_P * 4)(*(_ptr(lin.input_order) for lin in _linears(layer))))


def _takes_cache(dtype: torch.dtype) -> bool:
    """A bf16 cache, or an 8-bit one (int8, float8: quantization/kv_cache.py)."""
    return dtype == torch.bfloat16 or kv_quant.is_quantized(dtype)


def _linear_lora(lora) -> _LinearLoRA:
    """A LinearLoRA's packed slots (fixed addresses: set_slot repacks in place and updates slot_widths)."""
    return _LinearLoRA(lora.packed_a.data_ptr(), lora.packed_b.data_ptr(), lora.slot_widths.data_ptr(),
                       lora.packed_a.shape[1], lora.packed_b.shape[1])
