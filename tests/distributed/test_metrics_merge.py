"""The ingress's /metrics: its own counters once, the replicas' families with a replica label, valid text."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.distributed.metrics_merge import merge_metrics
from pagedserve.metrics.prometheus import PrometheusStatLogger
from pagedserve.metrics.stats import EngineStats, IterationStats


def samples(text) -> dict:
    text = text.decode() if isinstance(text, bytes) else text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def replica_text(running: int) -> str:
    metrics = PrometheusStatLogger("m")
    metrics(EngineStats(num_running=running), IterationStats())
    return metrics.render().decode()


def test_replica_families_get_a_replica_label_and_ingress_counters_stay_unlabelled():
    ingress = PrometheusStatLogger("m")
    ingress.http_requests.labels("/v1/completions", "POST", "200").inc(3)
    merged = merge_metrics(ingress.render().decode(), {"r2": replica_text(2), "r1": replica_text(5)}).decode()
    got = samples(merged)
    running = "pagedserve:num_requests_running"
    assert got[(running, frozenset({"model_name": "m", "replica": "r1"}.items()))] == 5
    assert got[(running, frozenset({"model_name": "m", "replica": "r2"}.items()))] == 2
    assert not any(name == running and "replica" not in dict(labels) for name, labels in got)
    http = [(labels, v) for (name, labels), v in got.items() if name == "http_requests_total"]
    assert http == [(frozenset({"handler": "/v1/completions", "method": "POST", "status": "200"}.items()), 3.0)]


def test_each_family_is_declared_once_with_histograms_intact():
    merged = merge_metrics(PrometheusStatLogger("m").render().decode(),
                           {"a": replica_text(1), "b": replica_text(1)}).decode()
    types = [line for line in merged.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    # The text format's names (what promtool checks): a counter is declared under its _total name.
    assert "# TYPE pagedserve:prompt_tokens_total counter" in types
    assert merged.index("# TYPE pagedserve:prompt_tokens_total") < merged.index("pagedserve:prompt_tokens_total{")
    ttft = [f for f in text_string_to_metric_families(merged) if f.name == "pagedserve:time_to_first_token_seconds"]
    assert len(ttft) == 1 and ttft[0].type == "histogram"
    assert {s.labels["replica"] for s in ttft[0].samples} == {"a", "b"}


def test_no_replicas_leaves_the_ingress_counters_only():
    merged = merge_metrics(PrometheusStatLogger("m").render().decode(), {}).decode()
    names = {f.name for f in text_string_to_metric_families(merged)}
    assert "http_requests" in names and "pagedserve:num_requests_running" not in names
