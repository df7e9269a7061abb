"""Hugging Face model folders: config.json, one or many *.safetensors, tokenizer files."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Optional

import torch

from pagedserve.quantization.hf_quantized import TENSOR_SUFFIXES, QuantizationConfig, to_quantized_tensor


class HFFolderCheckpoint:
    """A Hugging Face model folder, with the same interface as GGUFCheckpoint."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face model folder or a .gguf file")
        self.path = path
        self.files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not self.files:
            raise FileNotFoundError(f"{path} has no *.safetensors weight files")

    @property
    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path)

    @property
    def quantization_config(self) -> Optional[dict]:
        """config.json's quantization_config (AWQ / GPTQ checkpoints), or None."""
        with open(os.path.join(self.path, "config.json")) as f:
            return json.load(f).get("quantization_config")

    def iter_weights(self, dtype: torch.dtype, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in the checkpoint's names, floats in `dtype`. keep_quantized (an AWQ / GPTQ
        checkpoint): each quantized linear comes once, as `<prefix>.weight` -> a QuantizedTensor."""
        from safetensors import safe_open

        config = QuantizationConfig.from_hf(self.quantization_config) if keep_quantized else None
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    prefix, _, suffix = name.rpartition(".")
                    if config is None or suffix not in TENSOR_SUFFIXES:
                        yield name, f.get_tensor(name).to(dtype)
                        continue
                    pending.setdefault(prefix, {})[suffix] = f.get_tensor(name)
        while pending:
            prefix, tensors = pending.popitem()
            yield f"{prefix}.weight", to_quantized_tensor(prefix, tensors, config)

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def generation_eos_token_ids(self) -> set[int]:
        """eos ids from generation_config.json, which may list several (e.g. Llama 3's <|eot_id|>)."""
        path = os.path.join(self.path, "generation_config.json")
        if not os.path.isfile(path):
            return set()
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])
