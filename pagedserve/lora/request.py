"""LoRARequest: which adapter a request runs with (vLLM's class and field names). Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter by name, id and folder, as vLLM's ``LoRARequest``.

    `lora_name` is what clients see (the server's model name for the adapter); `lora_int_id` (>= 1) is its
    number, unique per name while loaded; `lora_path` is a PEFT folder (adapter_config.json and
    adapter_model.safetensors) on this machine. Requests carry it to the engine core, which loads the adapter
    the first time it is named.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string, got {type(self.lora_path).__name__}")

    def describe(self) -> str:
        """How errors name the adapter: its name, id and path."""
        return f"LoRA adapter {self.lora_name!r} (id {self.lora_int_id}, path {self.lora_path!r})"
