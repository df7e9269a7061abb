"""What the engine core hands the front end: its CoreInfo once, an EngineCoreOutput per request per step, and
QueueFullError for a request it refuses. Plain data, no torch: the front end imports this before (and
without) the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_id: int
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    logprobs: Optional[list[tuple[int, float, int]]] = None
    """(token_id, logprob, rank): the sampled token first, then the top-N."""
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    first_scheduled_time: Optional[float] = None
    """On a request's first output only: when the scheduler first ran it (queue-time metrics)."""


@dataclass(frozen=True)
class CoreInfo:
    """What a front end needs to know about the core it talks to (sent once, when the core is ready)."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    num_blocks: int
    block_size: int
    bytes_per_block: int
    kv_cache_dtype: str = "auto"
    """The cache element type as configured (--kv-cache-dtype)."""


class QueueFullError(RuntimeError):
    """More requests are waiting to be scheduled than max_num_queued_requests allows."""
