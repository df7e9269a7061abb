"""A PEFT LoRA folder read into memory: every (layer, module)'s A and B, checked against the base model,
in the engine dtype, with the adapter's scaling folded into B (so the forward pass is x @ A.T @ B.T)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

import torch

from pagedserve.lora.peft_config import EMBEDDING_MODULES, AdapterSpec, adapter_error, read_adapter_spec
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.targets import PARENTS, LoRAShapes

WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True)
class LoRAAdapter:
    """One load of an adapter. `generation` is unique to this load: a reload (after a removal, or under a
    new id) gets a new one, so nothing keyed by it (slots, prefix-cache blocks) can serve the old weights."""

    lora_request: LoRARequest
    generation: int
    rank: int
    scaling: float
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    """(layer, module) -> (A [rank, in], B [out, rank] times scaling), on CPU in the engine dtype."""

    @property
    def name(self) -> str:
        return self.lora_request.lora_name

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(lora_request: LoRARequest, shapes: LoRAShapes, max_rank: int, dtype: torch.dtype,
                 generation: int) -> LoRAAdapter:
    """Read and check the adapter; ValueError (naming it and the reason) when it cannot be served."""
    spec = read_adapter_spec(lora_request, max_rank)
    tensors = _read_tensors(lora_request)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, which = _parse_key(lora_request, key, shapes, spec)
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise adapter_error(lora_request, f"{WEIGHTS_FILE} holds no LoRA tensors")
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        a, b = _check_pair(lora_request, layer, module, pair, shapes, spec)
        weights[(layer, module)] = (a.to(dtype).contiguous(), (b.float() * spec.scaling).to(dtype).contiguous())
    return LoRAAdapter(lora_request, generation, spec.rank, spec.scaling, weights)


def _read_tensors(lora_request: LoRARequest) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.path.join(lora_request.lora_path, WEIGHTS_FILE)
    if not os.path.isfile(path):
        found = " (only safetensors are read, not adapter_model.bin)" if os.path.isfile(
            os.path.join(lora_request.lora_path, "adapter_model.bin")) else ""
        raise adapter_error(lora_request, f"{WEIGHTS_FILE} not found in {lora_request.lora_path!r}{found}")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise adapter_error(lora_request, f"{WEIGHTS_FILE} is not readable ({e})") from None


def _parse_key(lora_request: LoRARequest, key: str, shapes: LoRAShapes, spec: AdapterSpec) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a tensor name; anything else is refused by name."""
    if any(f"{name}." in key for name in EMBEDDING_MODULES):
        raise adapter_error(lora_request, f"tensor {key!r} adapts embed_tokens or lm_head; LoRA on embeddings "
                                          "or the LM head is not supported")
    match = _KEY.fullmatch(key)
    if match is None:
        raise adapter_error(lora_request, f"unknown tensor {key!r} in {WEIGHTS_FILE} (expected "
                                          "base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_A/B.weight)")
    layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
    if PARENTS.get(module) != parent:
        raise adapter_error(lora_request, f"tensor {key!r} targets {parent}.{module}, which this model does not "
                                          f"have (LoRA targets here: {', '.join(PARENTS)})")
    if spec.target_modules is not None and module not in spec.target_modules:
        raise adapter_error(lora_request, f"tensor {key!r} is for {module}, which target_modules does not list")
    if layer >= shapes.num_layers:
        raise adapter_error(lora_request, f"tensor {key!r} is for layer {layer}; the model has "
                                          f"{shapes.num_layers} layers")
    return layer, module, which


def _check_pair(lora_request: LoRARequest, layer: int, module: str, pair: dict[str, torch.Tensor],
                shapes: LoRAShapes, spec: AdapterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"layers.{layer}.{module}"
    missing = [f"lora_{w}" for w in ("A", "B") if w not in pair]
    if missing:
        raise adapter_error(lora_request, f"{where} has no {' or '.join(missing)} weight")
    a, b = pair["A"], pair["B"]
    in_features, out_features = shapes.features[module]
    expected_a, expected_b = (spec.rank, in_features), (out_features, spec.rank)
    if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise adapter_error(lora_request, f"{where}: lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}, but "
                                          f"rank {spec.rank} on this model needs {expected_a} and {expected_b} "
                                          "(an adapter for another base model?)")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise adapter_error(lora_request, f"{where}: LoRA weights must be floating point, got {a.dtype}/{b.dtype}")
    return a, b
