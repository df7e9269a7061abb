"""Hugging Face model folders: config.json, one or many *.safetensors, tokenizer files."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch


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

    def iter_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).to(dtype)

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
