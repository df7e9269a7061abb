"""What generate() returns: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    """1 = the most likely token."""
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, Logprob]]] = None
    """Per generated position: the sampled token and the top-N tokens, with their logprobs."""
    finish_reason: Optional[str] = None
    """'stop' (eos, a stop token id or a stop string), 'length' (max_tokens or context full) or 'abort'."""
    stop_reason: Union[int, str, None] = None
    """The stop string or stop token id that ended the sequence; None for eos or length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    first_scheduled_time: Optional[float] = None
    """When the scheduler first ran the request (of its first child, with n > 1)."""

    @property
    def time_to_first_token(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache instead of being computed."""
    replica: Optional[str] = None
    """The engine replica that ran the request, on its first output (scale-out on Ray); None otherwise."""
