"""What the engine core hands the front end for one request after a step."""

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
