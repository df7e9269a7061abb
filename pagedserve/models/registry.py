"""Maps the `architectures` name of a HF config to the model class that implements it."""

from __future__ import annotations

from torch import nn

from pagedserve.models.llama import LlamaForCausalLM, Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def get_model_class(hf_config) -> type[nn.Module]:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(f"model architecture {architectures or 'unknown'} is not supported; "
                     f"supported: {', '.join(sorted(MODEL_REGISTRY))}")
