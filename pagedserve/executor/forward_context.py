"""The one per-step global: what every layer may read about the step during a forward pass.

Set by the model runner around ``model(...)`` so that model code keeps HF-like signatures
(``forward(hidden, cos, sin)``) instead of threading batch layout through every layer. It holds the
attention metadata and, when some rows of the step run with a LoRA adapter, the LoRA mapping.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional

from pagedserve.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagedserve.lora.mapping import LoRAMapping


class ForwardContext(NamedTuple):
    attention: AttentionMetadata
    lora: Optional["LoRAMapping"] = None


_current: Optional[ForwardContext] = None


@contextmanager
def set_forward_context(metadata: AttentionMetadata, lora_mapping: Optional["LoRAMapping"] = None
                        ) -> Iterator[None]:
    """`lora_mapping` is None when no row of the step has an adapter (LoRA then costs one check a linear)."""
    global _current
    previous, _current = _current, ForwardContext(metadata, lora_mapping)
    try:
        yield
    finally:
        _current = previous


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention layers run only inside set_forward_context (the model runner sets it)")
    return _current.attention


def get_lora_mapping() -> Optional["LoRAMapping"]:
    """The step's LoRA mapping; None outside a forward pass or when no row of the step has an adapter."""
    return None if _current is None else _current.lora
