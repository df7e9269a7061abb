"""Finds the model, reads its checkpoint, builds the model and tokenizer."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from pagedserve.config import ModelConfig
from pagedserve.loader.default_model import default_model_path
from pagedserve.models.registry import get_model_class

logger = logging.getLogger(__name__)


def open_checkpoint(model: Optional[str]):
    """A GGUFCheckpoint or HFFolderCheckpoint for `model` (default model when None)."""
    path = default_model_path() if model is None else model
    if os.path.isfile(path) and path.endswith(".gguf"):
        from pagedserve.loader.gguf import GGUFCheckpoint

        return GGUFCheckpoint(path)
    if os.path.isdir(path):
        from pagedserve.loader.safetensors import HFFolderCheckpoint

        return HFFolderCheckpoint(path)
    raise FileNotFoundError(f"model {path!r} is neither a .gguf file nor a Hugging Face model folder "
                            "(nothing is downloaded from a model hub)")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 where the hardware computes it natively, else float32."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_config: object
    tokenizer: object  # None with skip_tokenizer_init
    eos_token_ids: frozenset[int]
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    load_seconds: float


def load_model(config: ModelConfig) -> LoadedModel:
    """Read the checkpoint, build the model in the target dtype/device and load its weights."""
    start = time.perf_counter()
    checkpoint = open_checkpoint(config.model)
    hf_config = checkpoint.config
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    max_model_len = context_length(hf_config, config.max_model_len)
    # Build on the meta device so that no time goes into random initialisation, then allocate for real.
    model, model_cls = _model_on_meta(hf_config, max_model_len, checkpoint)
    model = model.to(dtype).to_empty(device=device)
    model.rotary.to(device)
    model.load_weights(checkpoint.iter_weights(dtype, **_weight_options(config, checkpoint, device, dtype)))
    model.eval()
    _log_quantized(model)
    tokenizer = load_tokenizer(config, checkpoint)
    eos = eos_token_ids(checkpoint, hf_config, tokenizer)
    seconds = time.perf_counter() - start
    logger.info("loaded %s (%s, %s on %s) in %.1f s", config.model or "default model", model_cls.__name__,
                str(dtype).removeprefix("torch."), device, seconds)
    return LoadedModel(model, hf_config, tokenizer, eos, dtype, device, max_model_len, seconds)


MIN_BITS_PER_WEIGHT = 1
"""No checkpoint format stores a weight in less (GGUF's smallest, IQ1_S, takes 1.56 bits)."""
ROPE_TABLES_ALLOWANCE = 64 << 20
"""Bytes of rope tables any model may have, however small its weights (then a max_model_len caps them)."""
_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads")
# What building a model from a config of inconsistent sizes or rope settings raises (in the model, the rope
# tables or transformers' rope functions); each becomes a ValueError naming the config's file. Not RuntimeError:
# that is what a failed allocation raises, which the checks above are there to prevent, not to hide.
_BUILD_ERRORS = (TypeError, ValueError, ArithmeticError, KeyError, IndexError, AttributeError)


def _model_on_meta(hf_config, max_model_len: int, checkpoint) -> tuple[torch.nn.Module, type]:
    """The model built on the meta device (no time in random initialisation), after checking that its config
    is one the checkpoint can hold: a corrupt config.json or GGUF header (hidden_size or a layer count of
    2**40) is a ValueError naming the file, not an allocation of terabytes or a loop over 2**40 layers."""
    try:
        _check_sizes(hf_config, max_model_len, checkpoint.total_bytes())
        model_cls = get_model_class(hf_config)
        with torch.device("meta"):  # the rope tables alone are computed for real, on the CPU
            model = model_cls(hf_config, max_positions=max_model_len)
    except _BUILD_ERRORS as e:
        raise ValueError(f"{checkpoint.config_path}: its config does not describe a model this engine can build "
                         f"({type(e).__name__}: {e})") from e
    return model, model_cls


def _check_sizes(hf_config, max_model_len: int, held: int) -> None:
    """The config's sizes are positive integers, and what they make the engine allocate fits the checkpoint's
    bytes: the weights (embeddings and each layer's attention and MLP, a lower bound) at MIN_BITS_PER_WEIGHT,
    and the rope tables (cos and sin in float32 for every position; a tiny test model may have a long context,
    so they get at least ROPE_TABLES_ALLOWANCE)."""
    sizes = {name: getattr(hf_config, name, None) for name in _SIZE_FIELDS}
    _require_positive(sizes)
    head_dim = getattr(hf_config, "head_dim", None) or sizes["hidden_size"] // sizes["num_attention_heads"]
    _require_positive({"head_dim": head_dim, "max_model_len (the context length)": max_model_len})
    hidden = sizes["hidden_size"]
    attention = 2 * hidden * head_dim * (sizes["num_attention_heads"] + sizes["num_key_value_heads"])
    weights = sizes["vocab_size"] * hidden + sizes["num_hidden_layers"] * (
        attention + 3 * hidden * sizes["intermediate_size"])
    if weights * MIN_BITS_PER_WEIGHT // 8 > held:
        raise ValueError(f"it describes at least {weights:,} weights, more than its {held:,} bytes of weights "
                         "can hold")
    rope_bytes = 2 * 4 * max_model_len * head_dim
    if rope_bytes > max(held, ROPE_TABLES_ALLOWANCE):
        raise ValueError(f"rope tables for {max_model_len:,} positions of head_dim {head_dim} would take "
                         f"{rope_bytes:,} bytes, more than its {held:,} bytes of weights (or "
                         f"{ROPE_TABLES_ALLOWANCE:,}, whichever is more)")


def _require_positive(sizes: dict) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} is {value!r}, not a positive integer")


def _weight_options(config: ModelConfig, checkpoint, device: torch.device, dtype: torch.dtype) -> dict:
    """What iter_weights needs for config.quantization; a ValueError, before any weight loads, where it
    cannot run."""
    checkpoint_method = _checkpoint_method(checkpoint)
    method = config.quantization or checkpoint_method
    if method is None:
        return {}
    if method == "gguf" and not hasattr(checkpoint, "architecture"):  # not a GGUFCheckpoint
        raise ValueError(f"quantization={method!r} needs a GGUF file; {config.model!r} is a folder")
    if method in ("awq", "gptq") and method != checkpoint_method:
        raise ValueError(f"quantization={method!r} needs a checkpoint quantized with it; {config.model!r} has "
                         f"{'quantization_config ' + repr(checkpoint_method) if checkpoint_method else 'none'}")
    if method != "gguf":  # awq, gptq, or whatever else the checkpoint's quantization_config names
        from pagedserve.quantization.hf_quantized import QuantizationConfig

        QuantizationConfig.from_hf(checkpoint.quantization_config)  # unsupported variants refused before loading
    if device.type != "cpu":
        hint = "" if method in ("awq", "gptq") else ", or no --quantization to dequantize the weights"
        raise ValueError(f"quantization={method!r} runs on CPU only (its kernel is C); the device is "
                         f"{device.type}: use --device cpu{hint}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantization={method!r} takes float32 or bfloat16 activations, not {dtype}")
    return {"keep_quantized": True}


def _checkpoint_method(checkpoint) -> Optional[str]:
    """The method an HF checkpoint was quantized with (its quantization_config), lower case; None if none."""
    config = getattr(checkpoint, "quantization_config", None)
    return str(config.get("quant_method", "unknown")).lower() if config else None


def _log_quantized(model: torch.nn.Module) -> None:
    from pagedserve.kernels import quant_gemm

    kept = [(name, m.quantized) for name, m in model.named_modules() if getattr(m, "quantized", None) is not None]
    if kept:
        weights = [w for _, w in kept]
        tables = [name.rsplit(".", 1)[-1] for name, _ in kept if name.endswith(("embed_tokens", "lm_head"))]
        compact = quant_gemm.HALF_SCALES | quant_gemm.SUPER_SCALES | quant_gemm.GROUP_SCALES
        half = sum(w.nbytes for w in weights if w.flags & compact)
        logger.info("%d weights kept quantized (%s%s; %.1f MiB, %.0f%% of it with float16 scales as the file "
                    "holds them, not float32 per 32), computed by the "
                    "%s kernel", len(weights), ", ".join(sorted({w.source_type for w in weights})),
                    f"; with {' and '.join(tables)}" if tables else "", sum(w.nbytes for w in weights) / 2**20,
                    100 * half / sum(w.nbytes for w in weights), quant_gemm.kernel_name())


def load_tokenizer(config: ModelConfig, checkpoint=None):
    """The model's tokenizer (config.tokenizer overrides the checkpoint's); None with skip_tokenizer_init."""
    if config.skip_tokenizer_init:
        return None
    if config.tokenizer:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(config.tokenizer)
    return (checkpoint or open_checkpoint(config.model)).tokenizer()


def eos_token_ids(checkpoint, hf_config, tokenizer=None) -> frozenset[int]:
    """End-of-sequence ids from generation_config, the model config and the tokenizer (when there is one)."""
    eos = set(getattr(checkpoint, "generation_eos_token_ids", lambda: set())())
    eos_config = getattr(hf_config, "eos_token_id", None)
    eos |= set(eos_config if isinstance(eos_config, list) else [] if eos_config is None else [eos_config])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return frozenset(eos)


def context_length(hf_config, requested: Optional[int]) -> int:
    native = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is None:
        return native
    if requested < 2:
        raise ValueError(f"max_model_len must be >= 2, got {requested}")
    if requested > native:
        raise ValueError(f"max_model_len={requested} is longer than the model's context length ({native})")
    return requested
