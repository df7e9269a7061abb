"""The ingress's /metrics: what the ingress itself counts (HTTP requests, tenants, rate limits, adapters' tokens:
the gate and the routes run there) and every other family from the replicas' reports, each sample labelled
with its `replica`. A family appears once, with the samples of every replica under it."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

INGRESS_FAMILIES = frozenset({"http_requests", "pagedserve:tenant_requests", "pagedserve:tenant_prompt_tokens",
                              "pagedserve:tenant_generation_tokens", "pagedserve:rate_limited_requests",
                              "pagedserve:lora_requests", "pagedserve:lora_generation_tokens"})
"""Families whose samples the ingress counts; a replica's copies of them stay at zero and are left out."""


def merge_metrics(ingress_text: str, replica_texts: dict[str, str]) -> str:
    """One Prometheus text exposition out of the ingress's own and the replicas' (replica id -> text)."""
    families: dict[str, tuple[str, str, list[str]]] = {}

    def add(text: str, replica=None) -> None:
        for family in text_string_to_metric_families(text):
            if (family.name in INGRESS_FAMILIES) != (replica is None):
                continue
            entry = families.setdefault(family.name, (family.type, family.documentation, []))
            for sample in family.samples:
                labels = dict(sample.labels)
                if replica is not None:
                    labels["replica"] = replica
                entry[2].append(_sample_line(sample.name, labels, sample.value))

    add(ingress_text)
    for replica in sorted(replica_texts):
        add(replica_texts[replica], replica)
    lines = []
    for name, (kind, doc, samples) in families.items():
        lines.append(f"# HELP {name} {_escape_help(doc)}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(samples)
    return "\n".join(lines) + "\n"


def _sample_line(name: str, labels: dict[str, str], value: float) -> str:
    if not labels:
        return f"{name} {floatToGoString(value)}"
    pairs = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
    return f"{name}{{{pairs}}} {floatToGoString(value)}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(doc: str) -> str:
    return doc.replace("\\", "\\\\").replace("\n", "\\n")
