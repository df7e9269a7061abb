"""The ingress's /metrics: what the ingress itself counts (HTTP requests, tenants, rate limits, adapters' tokens:
the gate and the routes run there) and every other family from the replicas' reports, each sample labelled
with its `replica`. A family appears once, with the samples of every replica under it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

INGRESS_FAMILIES = frozenset({"http_requests", "pagedserve:tenant_requests", "pagedserve:tenant_prompt_tokens",
                              "pagedserve:tenant_generation_tokens", "pagedserve:rate_limited_requests",
                              "pagedserve:lora_requests", "pagedserve:lora_generation_tokens"})
"""Families whose samples the ingress counts; a replica's copies of them stay at zero and are left out."""


def merge_metrics(ingress_text: str, replica_texts: dict[str, str]) -> bytes:
    """One Prometheus text exposition out of the ingress's own and the replicas' (replica id -> text), written by
    prometheus-client itself (so counters keep their `_total` names in HELP and TYPE)."""
    families: dict[str, Metric] = {}

    def add(text: str, replica=None) -> None:
        for family in text_string_to_metric_families(text):
            if (family.name in INGRESS_FAMILIES) != (replica is None):
                continue
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                labels = dict(sample.labels) if replica is None else {**sample.labels, "replica": replica}
                merged.add_sample(sample.name, labels, sample.value)

    add(ingress_text)
    for replica in sorted(replica_texts):
        add(replica_texts[replica], replica)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return self.families
