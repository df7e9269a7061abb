"""The one per-step global: attention metadata that every attention layer reads during a forward pass.

Set by the model runner around ``model(...)`` so that model code keeps HF-like signatures
(``forward(hidden, cos, sin)``) instead of threading batch layout through every layer.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

from pagedserve.attention.metadata import AttentionMetadata

_current: Optional[AttentionMetadata] = None


@contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention layers run only inside set_forward_context (the model runner sets it)")
    return _current
