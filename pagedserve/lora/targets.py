"""Where a PEFT module name lands in this engine's model: q/k/v_proj are output slices of the fused
qkv_proj, gate/up_proj of gate_up_proj, o_proj and down_proj are linears of their own.

The adapter loader checks tensor shapes against `LoRAShapes` (plain numbers, no model reference); the slot
weights attach to the linears through `fused_linears`.
"""

from __future__ import annotations

from dataclasses import dataclass

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
"""The HF submodule each target lives in (model.layers.N.<parent>.<module>)."""


@dataclass(frozen=True)
class OutputSlice:
    module: str
    """The HF module name (q_proj ...) whose output these rows of the fused linear are."""
    offset: int
    size: int


@dataclass(frozen=True)
class FusedLinear:
    """One of a decoder layer's linears and the HF modules fused into it, in output order."""

    attribute: str
    """Path from the decoder layer, e.g. "self_attn.qkv_proj"."""
    in_features: int
    out_features: int
    slices: tuple[OutputSlice, ...]


@dataclass(frozen=True)
class LoRAShapes:
    """What an adapter's tensors must fit: the number of layers and each module's (in, out) features."""

    num_layers: int
    features: dict[str, tuple[int, int]]


def fused_linears(model) -> tuple[FusedLinear, ...]:
    """The layout of a LlamaForCausalLM decoder layer (Llama, Mistral, Qwen2: all layers alike)."""
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    q, kv = attn.q_size, attn.kv_size
    inter = mlp.down_proj.in_features
    return (
        FusedLinear("self_attn.qkv_proj", attn.qkv_proj.in_features, attn.qkv_proj.out_features,
                    (OutputSlice("q_proj", 0, q), OutputSlice("k_proj", q, kv), OutputSlice("v_proj", q + kv, kv))),
        FusedLinear("self_attn.o_proj", attn.o_proj.in_features, attn.o_proj.out_features,
                    (OutputSlice("o_proj", 0, attn.o_proj.out_features),)),
        FusedLinear("mlp.gate_up_proj", mlp.gate_up_proj.in_features, mlp.gate_up_proj.out_features,
                    (OutputSlice("gate_proj", 0, inter), OutputSlice("up_proj", inter, inter))),
        FusedLinear("mlp.down_proj", mlp.down_proj.in_features, mlp.down_proj.out_features,
                    (OutputSlice("down_proj", 0, mlp.down_proj.out_features),)),
    )


def lora_shapes(model) -> LoRAShapes:
    features = {s.module: (linear.in_features, s.size) for linear in fused_linears(model) for s in linear.slices}
    return LoRAShapes(len(model.model.layers), features)
