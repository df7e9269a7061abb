"""What a front end publishes after each step: the core's gauge snapshot and the step's per-request events.

EngineStats is built by the core; IterationStats on the thread that processes outputs; both are handed to stat
loggers, which must treat them as read-only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from pagedserve.outputs import RequestOutput


@dataclass(frozen=True)
class EngineStats:
    """Gauges, read from the engine between steps."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    num_requests_holding_blocks: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    """Names of the LoRA adapters that running requests use (vLLM's lora_requests_info gauge)."""
    waiting_lora_adapters: tuple[str, ...] = ()
    """Names of the LoRA adapters that waiting requests use."""


@dataclass(frozen=True)
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    queue_time: Optional[float]
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What happened in one step."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class _Tracked:
    arrival_time: float
    num_prompt_tokens: int
    num_generation_tokens: int = 0
    last_token_time: Optional[float] = None


class StatsTracker:
    """Per-request timing state, on the thread that processes outputs. Aborted requests are dropped without a record."""

    def __init__(self) -> None:
        self._requests: dict[str, _Tracked] = {}

    def add(self, request_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        self._requests[request_id] = _Tracked(arrival_time, num_prompt_tokens)

    def drop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def record(self, outputs: list[RequestOutput], now: Optional[float] = None) -> IterationStats:
        now = time.time() if now is None else now
        stats = IterationStats()
        for out in outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:
                continue
            new_tokens = sum(len(c.token_ids) for c in out.outputs)
            if tracked.last_token_time is None:
                stats.num_prompt_tokens += tracked.num_prompt_tokens
                stats.time_to_first_tokens.append(now - tracked.arrival_time)
            else:
                stats.inter_token_latencies.append(now - tracked.last_token_time)
            tracked.last_token_time = now
            tracked.num_generation_tokens += new_tokens
            stats.num_generation_tokens += new_tokens
            if out.finished:
                del self._requests[out.request_id]
                scheduled = out.metrics.first_scheduled_time
                stats.finished.append(FinishedRequestStats(
                    out.outputs[0].finish_reason or "stop", now - tracked.arrival_time,
                    None if scheduled is None else max(0.0, scheduled - tracked.arrival_time),
                    tracked.num_prompt_tokens, tracked.num_generation_tokens))
        return stats
