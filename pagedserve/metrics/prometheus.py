"""Prometheus metrics with vLLM's names under the `pagedserve:` prefix, in a registry of the app's own.

`PrometheusStatLogger` is an AsyncLLM stat logger: it runs on AsyncLLM's output thread after each step, with the
step's snapshot and events (prometheus-client metrics are thread-safe). `TenantMetrics` counts the server's
requests, tokens and rate-limit refusals per tenant, with a bounded number of tenant label values.
"""

from __future__ import annotations

import threading
from typing import Optional

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedserve.metrics.stats import EngineStats, IterationStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

CONTENT_TYPE = CONTENT_TYPE_LATEST
OTHER_TENANTS = "other"
DEFAULT_MAX_METRIC_TENANTS = 32


class TenantLabels:
    """Tenant names as label values: the first `max_tenants` names seen keep their own, later ones all become
    "other", so that the number of series stays bounded however many tenants come and go."""

    def __init__(self, max_tenants: int) -> None:
        if max_tenants < 0:
            raise ValueError(f"max_metric_tenants must be >= 0, got {max_tenants}")
        self.max_tenants = max_tenants
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        with self._lock:
            if tenant in self._seen:
                return tenant
            if len(self._seen) < self.max_tenants:
                self._seen.add(tenant)
                return tenant
        return OTHER_TENANTS


class TenantMetrics:
    """Per-tenant counters of the HTTP side (labelled model_name and tenant)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_tenants: int) -> None:
        self.model_name, self.label = model_name, TenantLabels(max_tenants)
        labels = ["model_name", "tenant"]
        self._requests = Counter("pagedserve:tenant_requests", "Completion and chat requests by tenant and HTTP "
                                 "status.", [*labels, "status"], registry=registry)
        self._prompt_tokens = Counter("pagedserve:tenant_prompt_tokens", "Prompt tokens of a tenant's requests that "
                                      "produced output.", labels, registry=registry)
        self._generation_tokens = Counter("pagedserve:tenant_generation_tokens", "Tokens generated for a tenant.",
                                          labels, registry=registry)
        self._rate_limited = Counter("pagedserve:rate_limited_requests", "Requests refused by a tenant's rate "
                                     "limit (limit: requests, tokens or concurrency).", [*labels, "limit"],
                                     registry=registry)

    def count_request(self, tenant: str, status: int) -> None:
        self._requests.labels(self.model_name, self.label(tenant), str(status)).inc()

    def count_tokens(self, tenant: str, prompt_tokens: int, generation_tokens: int) -> None:
        label = self.label(tenant)
        self._prompt_tokens.labels(self.model_name, label).inc(prompt_tokens)
        self._generation_tokens.labels(self.model_name, label).inc(generation_tokens)

    def count_rate_limited(self, tenant: str, limit: str) -> None:
        self._rate_limited.labels(self.model_name, self.label(tenant), limit).inc()


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None,
                 max_tenants: int = DEFAULT_MAX_METRIC_TENANTS) -> None:
        disable_created_metrics()  # no *_created series (process-wide, as vLLM does)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.tenants = TenantMetrics(self.registry, model_name, max_tenants)
        r, labels, name = self.registry, ["model_name"], model_name

        def gauge(suffix: str, doc: str):
            return Gauge(f"pagedserve:{suffix}", doc, labels, registry=r).labels(name)

        def counter(suffix: str, doc: str):
            return Counter(f"pagedserve:{suffix}", doc, labels, registry=r).labels(name)

        def histogram(suffix: str, doc: str, buckets):
            return Histogram(f"pagedserve:{suffix}", doc, labels, buckets=buckets, registry=r).labels(name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (by recompute).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._request_success = Counter("pagedserve:request_success", "Requests finished, by finish reason.",
                                        ["model_name", "finished_reason"], registry=r)
        self.model_name = name
        for reason in ("stop", "length"):  # present from the start, at 0
            self._request_success.labels(name, reason)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token.",
                                             _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between a request's outputs.",
                                             _LATENCY_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                            _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per finished request (all n samples).",
                                                   _TOKEN_BUCKETS)
        self.http_requests = Counter("http_requests", "HTTP requests by route, method and status.",
                                     ["handler", "method", "status"], registry=r)
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0)

    def __call__(self, stats: EngineStats, iteration: IterationStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        if stats.num_preemptions_total > self._preemptions_seen:
            self.num_preemptions.inc(stats.num_preemptions_total - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions_total
        queries, hits = stats.prefix_cache_queries_total, stats.prefix_cache_hits_total
        if (queries, hits) > self._prefix_seen:
            self.prefix_cache_queries.inc(queries - self._prefix_seen[0])
            self.prefix_cache_hits.inc(hits - self._prefix_seen[1])
            self._prefix_seen = (queries, hits)
        if iteration.num_prompt_tokens:
            self.prompt_tokens.inc(iteration.num_prompt_tokens)
        if iteration.num_generation_tokens:
            self.generation_tokens.inc(iteration.num_generation_tokens)
        for t in iteration.time_to_first_tokens:
            self.time_to_first_token.observe(t)
        for t in iteration.inter_token_latencies:
            self.inter_token_latency.observe(t)
        for f in iteration.finished:
            self._request_success.labels(self.model_name, f.finish_reason).inc()
            self.e2e_request_latency.observe(f.e2e_latency)
            if f.queue_time is not None:
                self.request_queue_time.observe(f.queue_time)
            self.request_prompt_tokens.observe(f.num_prompt_tokens)
            self.request_generation_tokens.observe(f.num_generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
