"""Hugging Face model folders: config.json, one or many *.safetensors, tokenizer files."""

from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Iterator, Optional

import torch
from huggingface_hub.errors import StrictDataclassError

from pagedserve.quantization.hf_quantized import TENSOR_SUFFIXES, QuantizationConfig, to_quantized_tensor

# What transformers raises reading and validating a corrupt config.json: OSError for bad JSON, StrictDataclassError
# for a value of the wrong type, AttributeError for an unknown torch_dtype, ZeroDivisionError for 0 heads...
# Each becomes a ValueError naming the file.
_CONFIG_ERRORS = (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError,
                  RecursionError, StrictDataclassError)


class HFFolderCheckpoint:
    """A Hugging Face model folder, with the same interface as GGUFCheckpoint."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face model folder or a .gguf file")
        self.path = path
        self.config_path = os.path.join(path, "config.json")
        """The file the config comes from, which errors about the config name."""
        self.files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not self.files:
            raise FileNotFoundError(f"{path} has no *.safetensors weight files")

    @property
    def config(self):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.path)
        except _CONFIG_ERRORS as e:
            raise ValueError(f"{self.config_path}: not a model config this loader can read "
                             f"({type(e).__name__}: {e})") from e

    @property
    def quantization_config(self) -> Optional[dict]:
        """config.json's quantization_config (AWQ / GPTQ checkpoints), or None."""
        config = _json_object(self.config_path).get("quantization_config")
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"{self.config_path}: quantization_config is {config!r}, not an object")
        return config

    def iter_weights(self, dtype: torch.dtype, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in the checkpoint's names, floats in `dtype`. keep_quantized (an AWQ / GPTQ
        checkpoint): each quantized linear comes once, as `<prefix>.weight` -> a QuantizedTensor."""
        config = QuantizationConfig.from_hf(self.quantization_config) if keep_quantized else None
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for file in self.files:
            with _opened(file) as f:
                for name in f.keys():
                    prefix, _, suffix = name.rpartition(".")
                    if config is None or suffix not in TENSOR_SUFFIXES:
                        yield name, f.get_tensor(name).to(dtype)
                        continue
                    pending.setdefault(prefix, {})[suffix] = f.get_tensor(name)
        while pending:
            prefix, tensors = pending.popitem()
            yield f"{prefix}.weight", to_quantized_tensor(prefix, tensors, config)

    def total_bytes(self) -> int:
        """Size of the weights' file(s): what a model built from the config must fit in."""
        return sum(os.path.getsize(f) for f in self.files)

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def generation_eos_token_ids(self) -> set[int]:
        """eos ids from generation_config.json, which may list several (e.g. Llama 3's <|eot_id|>)."""
        path = os.path.join(self.path, "generation_config.json")
        if not os.path.isfile(path):
            return set()
        eos = _json_object(path).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"{path}: eos_token_id is {eos!r}, not a token id or a list of them")
        return set(ids)


def _json_object(path: str) -> dict:
    """The object a JSON file holds; bad JSON (or UTF-8), or another kind of value, is a ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path}: holds {type(value).__name__}, not a JSON object")
    return value


@contextlib.contextmanager
def _opened(file: str):
    """safe_open, with what a corrupt file raises (a bad header length, JSON, dtype, shape or offsets; a short
    read) as a ValueError naming it. The safetensors library checks all of that against the file's size before
    it maps or copies anything."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
