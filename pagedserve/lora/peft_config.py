"""adapter_config.json of a PEFT LoRA folder: read, checked, reduced to what the engine needs (AdapterSpec).

Anything that would change the adapter's forward pass in a way this engine does not compute is refused
here, before a tensor is read: an adapter is never served as something else (for instance as the base
model) without a word. Settings that only matter for training or initialisation are ignored.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from pagedserve.lora.request import LoRARequest
from pagedserve.lora.targets import TARGET_MODULES

CONFIG_FILE = "adapter_config.json"
EMBEDDING_MODULES = ("embed_tokens", "lm_head")

# Settings whose value never changes inference here (training, initialisation, bookkeeping, or read below).
_IGNORED = frozenset({
    "peft_type", "auto_mapping", "base_model_name_or_path", "revision", "task_type", "inference_mode",
    "peft_version", "init_lora_weights", "lora_dropout", "r", "lora_alpha", "use_rslora", "target_modules",
    "exclude_modules", "layers_to_transform", "layers_pattern", "bias", "fan_in_fan_out", "megatron_core",
    "qalora_group_size", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "ensure_weight_tying",
})

_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")
"""init_lora_weights values whose adapters only work on a base model changed by that initialisation."""

# Settings this engine does not compute, with the reason given when one is set.
_REFUSED = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained copies of modules) is not supported",
    "trainable_token_indices": "trainable tokens (trainable_token_indices) change the embeddings, which is "
                               "not supported",
    "rank_pattern": "rank_pattern (per-module ranks) is not supported",
    "alpha_pattern": "alpha_pattern (per-module alphas) is not supported",
    "lora_bias": "lora_bias (a bias on lora_B) is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "use_qalora": "QALoRA (use_qalora) is not supported",
    "layer_replication": "layer_replication is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
}


@dataclass(frozen=True)
class AdapterSpec:
    """What adapter_config.json says about the adapter's forward pass."""

    rank: int
    scaling: float
    """lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora: the factor on B @ A."""
    target_modules: Optional[tuple[str, ...]]
    """The module names the config lists, or None when it gives a pattern (the tensors then tell)."""


def adapter_error(lora_request: LoRARequest, reason: str) -> ValueError:
    """The one error shape for an adapter that cannot be served: which adapter, then why."""
    return ValueError(f"{lora_request.describe()} cannot be served: {reason}")


def read_adapter_spec(lora_request: LoRARequest, max_rank: int) -> AdapterSpec:
    """Read and check `lora_path`/adapter_config.json; ValueError (naming the adapter) when it cannot be served."""
    path = os.path.join(lora_request.lora_path, CONFIG_FILE)
    if not os.path.isfile(path):
        raise adapter_error(lora_request, f"{CONFIG_FILE} not found in {lora_request.lora_path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise adapter_error(lora_request, f"{CONFIG_FILE} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise adapter_error(lora_request, f"{CONFIG_FILE} is not a JSON object")
    _check_supported(lora_request, config)
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise adapter_error(lora_request, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise adapter_error(lora_request, f"its rank {rank} is above max_lora_rank={max_rank} "
                                          "(raise --max-lora-rank)")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise adapter_error(lora_request, f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterSpec(rank, float(scaling), _target_modules(lora_request, config.get("target_modules")))


def _check_supported(lora_request: LoRARequest, config: dict) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise adapter_error(lora_request, f"peft_type is {peft_type!r}; only LORA adapters are supported")
    for key, reason in _REFUSED.items():
        if config.get(key):
            raise adapter_error(lora_request, reason)
    bias = config.get("bias", "none")
    if bias != "none":
        raise adapter_error(lora_request, f"bias={bias!r} (trained biases) is not supported; only 'none'")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        # These inits move part of the base weights into the adapter; unconverted, the adapter needs that
        # residual base model, not ours.
        raise adapter_error(lora_request, f"init_lora_weights={init!r} changed the base model's weights when the "
                                          "adapter was made; convert it to a plain LoRA first (peft's "
                                          "path_initial_model_for_weight_conversion)")
    if config.get("fan_in_fan_out"):
        raise adapter_error(lora_request, "fan_in_fan_out (Conv1D-style transposed weights) is not supported")
    unknown = sorted(k for k, v in config.items() if k not in _IGNORED and k not in _REFUSED and v)
    if unknown:
        # A newer PEFT feature we do not know could change the forward pass: refuse rather than guess.
        raise adapter_error(lora_request, f"unsupported adapter_config.json setting(s): {', '.join(unknown)}")


def _target_modules(lora_request: LoRARequest, targets) -> Optional[tuple[str, ...]]:
    if targets is None or isinstance(targets, str):
        if isinstance(targets, str) and any(name in targets for name in EMBEDDING_MODULES):
            raise adapter_error(lora_request, f"target_modules {targets!r} includes embed_tokens or lm_head; "
                                              "LoRA on embeddings or the LM head is not supported")
        return None  # "all-linear" or a regular expression: the tensor names say which modules it hit
    names = tuple(str(name) for name in targets)
    for name in names:
        short = name.rsplit(".", 1)[-1]
        if short in EMBEDDING_MODULES:
            raise adapter_error(lora_request, f"it targets {name}; LoRA on embeddings or the LM head is not "
                                              "supported")
        if short not in TARGET_MODULES:
            raise adapter_error(lora_request, f"it targets {name!r}, which this model does not have "
                                              f"(LoRA targets here: {', '.join(TARGET_MODULES)})")
    return names
