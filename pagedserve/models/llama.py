"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2) and Qwen2 (the same with q/k/v biases).

Parameter names follow HF checkpoints, except that q/k/v and gate/up are fused into one matmul each;
`load_weights` routes the checkpoint's separate tensors into their slices.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable, NamedTuple, Optional

import torch
from torch import nn

from pagedserve.attention.torch_paged import paged_attention
from pagedserve.executor.cpu_allocator import HugePageArena, huge_page_zeros
from pagedserve.executor.forward_context import get_attention_metadata, get_lora_mapping
from pagedserve.kernels import f32_gemm, fused_ops, quant_gemm, skinny_gemm
from pagedserve.kernels.decode_layers import DecodeLayers
from pagedserve.layers.linear import Linear, empty_weight
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, apply_rotary
from pagedserve.layers.vocab_embedding import VocabEmbedding
from pagedserve.quantization.quantized_tensor import QuantizedParts, QuantizedTensor

logger = logging.getLogger(__name__)


class RopeInputs(NamedTuple):
    """What the layers need for rotary embeddings this step: the positions and the model's float32 tables
    (for the fused kernel), or cos/sin already gathered for the positions (for the torch path)."""

    positions: torch.Tensor
    table: RotaryEmbedding
    cos: Optional[torch.Tensor] = None
    sin: Optional[torch.Tensor] = None


class LlamaAttention(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        # Bound by the model runner once the KV cache exists (layouts: attention/kv_layout.py).
        self.key_cache: Optional[torch.Tensor] = None
        self.value_cache: Optional[torch.Tensor] = None
        self.kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # an 8-bit cache's scales

    def forward(self, hidden: torch.Tensor, rope: "RopeInputs") -> torch.Tensor:
        num_tokens = hidden.shape[0]
        meta = get_attention_metadata()
        qkv = self.qkv_proj(hidden)
        if rope.cos is None:  # fused: rotate q and k in place and store k/v in the cache, in one pass
            fused_ops.rotary_and_cache(qkv, rope.positions, rope.table.cos, rope.table.sin, self.key_cache,
                                       self.value_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads,
                                       self.head_dim, self.kv_scales)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if rope.cos is not None:
            q, k = apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)
        out = paged_attention(q, k, v, self.key_cache, self.value_cache, meta, kv_cached=rope.cos is None,
                              kv_scales=self.kv_scales)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_swiglu(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, o_bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], rope: "RopeInputs"
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in and out, as in HF: the residual stream is summed lazily by the next norm,
        which lets a fused kernel do the add and the norm in one pass."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, qkv_bias, o_bias)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def _packed_shape(weight: torch.Tensor) -> Optional[tuple[int, ...]]:
    """The shape of the weight's copy for the CPU kernel that takes its dtype, or None where none does."""
    if weight.dtype == torch.float32:
        return f32_gemm.PackedWeight.packed_shape(weight)
    return skinny_gemm.PackedWeight.packed_shape(weight)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden states [T, hidden]; compute_logits on the rows to sample."""

    # checkpoint name part -> (fused parameter name part, slice index)
    _fused = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, *self.attention_biases(config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        attn = self.model.layers[0].self_attn
        self.rotary = RotaryEmbedding(config, attn.head_dim, max_positions)
        self._packed_lm_head: Optional[skinny_gemm.PackedWeight] = None
        self._packed_lm_head_f32: Optional[f32_gemm.PackedWeight] = None
        """float32 on AVX2-only CPUs; the plain weight stays (the tied token embeddings read their rows from it)."""
        self._decode_layers: Optional[DecodeLayers] = None

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o): Llama's `attention_bias` sets both."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    @property
    def quantized_lm_head(self) -> Optional[quant_gemm.QuantizedWeight]:
        """The LM head's weight where it is kept quantized (tied: the embedding table's records), else None."""
        return (self.model.embed_tokens if self.tie_word_embeddings else self.lm_head).quantized

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        if fused_ops.fuses_rotary(hidden):
            rope = RopeInputs(positions, self.rotary)
        else:  # gathered once per step, shared by all layers
            rope = RopeInputs(positions, self.rotary, *self.rotary.cos_sin(positions, hidden.dtype))
        meta = get_attention_metadata()
        lora_mapping = get_lora_mapping()
        if self._decode_layers is not None and self._decode_layers.runs(hidden.shape[0], meta, lora_mapping):
            hidden, residual = self._decode_layers.forward(hidden, positions, self.rotary.cos, self.rotary.sin, meta,
                                                           lora_mapping)
        else:
            residual = None
            for layer in self.model.layers:
                hidden, residual = layer(hidden, residual, rope)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model dtype, as the reference computes them; the sampler widens them to float32 when
        it does more than an argmax."""
        if self.quantized_lm_head is not None:
            return quant_gemm.linear(hidden, self.quantized_lm_head)
        if self._packed_lm_head_f32 is not None:
            return f32_gemm.linear(hidden, self._packed_lm_head_f32)
        if self._packed_lm_head is not None and (hidden.shape[0] <= skinny_gemm.MAX_ROWS
                                                 or self.lm_head_weight.numel() == 0):
            return skinny_gemm.linear(hidden, self._packed_lm_head)
        return torch.nn.functional.linear(hidden, self.lm_head_weight)

    def pack_for_small_batches(self) -> int:
        """Give every linear layer and the LM head a weight copy laid out for small batches (CPU bfloat16;
        see layers/linear.py), and, where every kernel has its C path, run the layers of small decode-only
        steps as one C call (kernels/decode_layers.py). Returns how many weights were packed; call after the
        weights are loaded and the KV cache is bound.

        Where the packed kernel takes every batch as fast as torch (skinny_gemm.takes_every_batch: AVX-512 BF16)
        every bf16 weight is then held only packed, the LM head's too (tied: the token embeddings read their rows
        from it), so that resident weights stay near the checkpoint's size. Where it does not, the linears keep
        both copies, and so does the LM head unless the decoder's linears are kept quantized (AWQ, GPTQ, GGUF
        with a bf16 head): then it too is held only packed and runs on that kernel at every batch size.

        float32 weights on AVX2-only CPUs are packed for kernels/f32_gemm.py instead, which takes every batch:
        the linears are then held only packed; the LM head keeps its plain copy too."""
        linears = [m for m in self.model.modules() if isinstance(m, Linear) and m.quantized is None
                   and not m.held_packed_only]
        lm_head = self.lm_head_weight if self.quantized_lm_head is None and self.lm_head_weight.numel() else None
        weights = [m.weight for m in linears] + [lm_head]
        # One buffer for all of them, in huge pages: a small decode step streams every packed weight once.
        dtype = next((w.dtype for w in weights if w is not None), torch.bfloat16)  # the model's
        shapes = [_packed_shape(w) if w is not None and w.dtype == dtype else None for w in weights]
        sizes = [math.prod(shape) if shape else 0 for shape in shapes]
        arena = huge_page_zeros(dtype.itemsize * sum(sizes)).view(dtype) if any(sizes) else None
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        views = [arena[o:o + n] if n else None for o, n in zip(offsets, sizes)]
        packed = sum(m.pack_for_small_batches(view) for m, view in zip(linears, views))
        if weights[-1] is not None and weights[-1].dtype == torch.float32:
            self._packed_lm_head_f32 = f32_gemm.PackedWeight.of(weights[-1], views[-1])
            packed += self._packed_lm_head_f32 is not None
        elif weights[-1] is not None:
            self._packed_lm_head = skinny_gemm.PackedWeight.of(weights[-1], views[-1])
            if self._packed_lm_head is not None and (skinny_gemm.takes_every_batch() or any(
                    m.quantized is not None for m in self.model.modules() if isinstance(m, Linear))):
                self._hold_lm_head_packed_only()
        self._decode_layers = DecodeLayers.build(self)
        return packed + (self._packed_lm_head is not None)

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      kv_scales: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None) -> None:
        """Each layer's (key, value) cache tensors, and for an 8-bit cache their (key, value) scales."""
        for i, (layer, (key_cache, value_cache)) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            layer.self_attn.key_cache, layer.self_attn.value_cache = key_cache, value_cache
            layer.self_attn.kv_scales = kv_scales[i] if kv_scales is not None else None

    def _hold_lm_head_packed_only(self) -> None:
        empty = empty_weight(self.lm_head_weight)
        if self.tie_word_embeddings:
            self.model.embed_tokens.packed = self._packed_lm_head
            self.model.embed_tokens.weight = empty
        else:
            self.lm_head.weight = empty
        logger.info("LM head (%d x %d bf16%s) held once, packed for the small-batch kernel",
                    self._packed_lm_head.out_features, self._packed_lm_head.in_features,
                    ", the tied token embeddings read from it" if self.tie_word_embeddings else "")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        # Kept-quantized weights (CPU only) in huge pages, as the packed bf16 copies are: a decode step streams them.
        quantized = QuantizedParts(self, self._num_shards, HugePageArena().take)
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            target, shard = name, None
            for part, (fused, index) in self._fused.items():
                if f".{part}." in name:
                    target, shard = name.replace(part, fused), index
                    break
            if target not in params:
                if name.endswith(".bias") and not tensor.any():
                    continue  # older GPTQ exporters save all-zero biases for layers that have none
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            param = params[target]
            dest = param if shard is None else self._shard(target, param, shard)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            if isinstance(tensor, QuantizedTensor):
                if isinstance(self.get_submodule(target.removesuffix(".weight")), (Linear, VocabEmbedding)):
                    if quantized.add(target, shard or 0, tensor, dest):
                        params[target] = self.get_parameter(target)  # the float weight, now empty, freed
                else:
                    dest.copy_(tensor.dequantize())
            else:
                dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + 1
        missing = [n for n, p in params.items() if filled.get(n, 0) < self._num_shards(n)]
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
        quantized.finish()

    def _shard(self, name: str, param: torch.Tensor, index: int) -> torch.Tensor:
        attn = self.model.layers[0].self_attn
        if "qkv_proj" in name:
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [param.shape[0] // 2] * 2
        start = sum(sizes[:index])
        return param.narrow(0, start, sizes[index])

    @staticmethod
    def _num_shards(name: str) -> int:
        return 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else 1


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on the q/k/v projections (none on o)."""

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return True, False
