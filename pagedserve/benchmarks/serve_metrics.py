"""What `pagedserve bench serve` computes from the per-request timings, and the server's own /metrics.

Per request (all times from the client's clock, `time.perf_counter`):

* TTFT: from sending the request to receiving the first chunk that carries generated text (when all of a
  request's tokens decode to no text, e.g. special tokens, but usage counts them: its first chunk);
* ITL: the gaps between consecutive chunks with text (a chunk holding several tokens is one gap, as in vLLM);
* E2E latency: from sending to the end of the stream;
* TPOT: (E2E - TTFT) / (output tokens - 1), only for requests with more than one output token;
* output tokens: the server's `usage.completion_tokens` when it sends usage, else the tokenizer's count of
  the generated text when there is a tokenizer, else the number of chunks with text.

Goodput (`--goodput ttft:MS tpot:MS e2el:MS`): requests per second that met every given objective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float = 0.0  # seconds, E2E
    start_time: float = 0.0  # perf_counter at send
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each chunk with text
    usage: Optional[dict] = None

    @property
    def cached_tokens(self) -> Optional[int]:
        """Prompt tokens the server says came from its prefix cache (usage.prompt_tokens_details); None when it
        does not say."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return None if value is None else int(value)

    @property
    def tpot(self) -> Optional[float]:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_goodput(items: Optional[list[str]]) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {item!r}: expected NAME:MILLISECONDS with NAME one of {', '.join(GOODPUT_KEYS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: must be >= 0")
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2el": r.latency}
    return all(values[k] * 1000 <= slo for k, slo in slos.items())


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at one instant (sends and ends, ends first on ties)."""
    events = []
    for r in results:
        events.append((r.start_time, 1))
        events.append((r.start_time + r.latency, -1))
    peak = live = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        live += delta
        peak = max(peak, live)
    return peak


def token_times(r: RequestResult) -> list[tuple[float, float]]:
    """(time, tokens) per chunk: the request's output tokens spread evenly over its chunks."""
    if not r.chunk_times:
        return []
    per_chunk = r.output_tokens / len(r.chunk_times)
    return [(t, per_chunk) for t in r.chunk_times]


def _summary(name: str, values_s: list[float], percentiles: list[float], out: dict) -> None:
    ms = np.asarray(values_s, dtype=float) * 1000
    empty = ms.size == 0
    out[f"mean_{name}_ms"] = 0.0 if empty else float(ms.mean())
    out[f"median_{name}_ms"] = 0.0 if empty else float(np.median(ms))
    out[f"std_{name}_ms"] = 0.0 if empty else float(ms.std())
    for p in percentiles:
        label = f"{p:g}".replace(".", "_") if not float(p).is_integer() else str(int(p))
        out[f"p{label}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))


def compute_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                    slos: dict[str, float], start: float) -> dict:
    """The result dict: vLLM's keys (completed, duration, ..., mean_ttft_ms, ...) and ours beside them."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = sum(1 for r in ok if meets_slos(r, slos)) if slos else None
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(good) if good is not None else None,
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "max_concurrent_requests": peak_concurrency(results),
    }
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    out["total_cached_tokens"] = sum(cached) if cached else None
    out["cached_token_share"] = sum(cached) / total_in if cached and total_in else None
    buckets: dict[int, float] = {}
    for r in ok:
        for t, n in token_times(r):
            buckets[int(t - start)] = buckets.get(int(t - start), 0.0) + n
    out["max_output_tokens_per_s"] = max(buckets.values()) if buckets else 0.0
    _summary("ttft", [r.ttft for r in ok], percentiles, out)
    _summary("tpot", [r.tpot for r in ok if r.tpot is not None], percentiles, out)
    _summary("itl", [x for r in ok for x in r.itl], percentiles, out)
    _summary("e2el", [r.latency for r in ok], percentiles, out)
    return out


# ---------------------------------------------------------------------------------------------------------
# The server's /metrics (Prometheus text): pagedserve's and vLLM's names

SERVER_PREFIXES = ("pagedserve:", "vllm:")
# what we report -> the sample name after the prefix (summed over label sets)
SERVER_SAMPLES = {
    "queue_time_sum_s": "request_queue_time_seconds_sum",
    "queue_time_count": "request_queue_time_seconds_count",
    "num_preemptions": "num_preemptions_total",
    "prefix_cache_hits": "prefix_cache_hits_total",
    "prefix_cache_queries": "prefix_cache_queries_total",
    "prompt_tokens": "prompt_tokens_total",
    "generation_tokens": "generation_tokens_total",
    "ttft_sum_s": "time_to_first_token_seconds_sum",
    "ttft_count": "time_to_first_token_seconds_count",
}


def parse_server_metrics(text: str) -> dict[str, float]:
    """The counters of SERVER_SAMPLES found in a Prometheus text page (absent ones are left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {prefix + sample: key for key, sample in SERVER_SAMPLES.items() for prefix in SERVER_PREFIXES}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None and not math.isnan(sample.value):
                found[key] = found.get(key, 0.0) + sample.value
    return found


def server_view(before: Optional[dict[str, float]], after: Optional[dict[str, float]]) -> Optional[dict]:
    """What changed on the server during the run, in the server's own words."""
    if before is None or after is None:
        return None
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    view: dict = {"counters_delta": delta}
    if delta.get("queue_time_count"):
        view["mean_queue_time_ms"] = 1000 * delta.get("queue_time_sum_s", 0.0) / delta["queue_time_count"]
    if delta.get("ttft_count"):
        view["mean_ttft_ms"] = 1000 * delta.get("ttft_sum_s", 0.0) / delta["ttft_count"]
    if "num_preemptions" in delta:
        view["num_preemptions"] = delta["num_preemptions"]
    if "prefix_cache_queries" in delta:
        queries = delta["prefix_cache_queries"]
        view["prefix_cache_hits"] = delta.get("prefix_cache_hits", 0.0)
        view["prefix_cache_queries"] = queries
        view["prefix_cache_hit_rate"] = view["prefix_cache_hits"] / queries if queries else None
    return view
