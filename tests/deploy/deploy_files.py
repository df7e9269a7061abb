"""The deploy/ folder's files, and what the tests need to read them: the PromQL of the dashboard, the rules,
the autoscalers; the metric names a query uses; the metric names a live server exports."""

from __future__ import annotations

import json
import os
import re
import shutil

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEPLOY = os.path.join(ROOT, "deploy")
PROMETHEUS_DIR = os.path.join(DEPLOY, "prometheus")
RULE_FILES = [os.path.join(PROMETHEUS_DIR, "rules", name) for name in ("pagedserve-recording.yml",
                                                                      "pagedserve-alerts.yml")]
DASHBOARD = os.path.join(DEPLOY, "grafana", "dashboards", "pagedserve.json")
KUBERNETES = os.path.join(DEPLOY, "kubernetes")

METRIC = re.compile(r"\b(pagedserve:[A-Za-z0-9_:]+|http_requests_total|up)\b")
THRESHOLD = re.compile(r"\s*(>|<|>=|<=|==|!=)\s*[-+0-9.e]+\s*$")
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$job": ".*", "$instance": ".*", "$model_name": ".*"}


def load_yaml(path: str):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard target, Grafana's variables filled in as the default view does."""
    with open(DASHBOARD, encoding="utf-8") as f:
        panels = json.load(f)["panels"]
    out = []
    for panel in panels:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            out.append((panel["title"], expr))
    return out


def rules() -> list[dict]:
    """Every recording rule and alert of the shipped rule files."""
    return [rule for path in RULE_FILES for group in load_yaml(path)["groups"] for rule in group["rules"]]


def alert_operands(expr: str) -> list[str]:
    """The parts of an alert's expression that must return data while the server runs: each side of a
    top-level `and`, without its threshold comparison (`x > 2` is empty until x passes 2; x is not)."""
    return [THRESHOLD.sub("", part).strip() for part in expr.split(" and ")]


ADAPTER_TEST_LABELS = {"namespace": "ns", "pod": "pagedserve-0"}
"""The labels the live test's Prometheus adds to its target, as the operator's per-pod scrape does."""


def autoscaler_queries() -> list[tuple[str, str]]:
    """(source, PromQL) of the KEDA trigger, and of the prometheus-adapter rule as the adapter runs it: its
    series query (discovery), and its metrics query with the template filled in for one pod."""
    keda = load_yaml(os.path.join(KUBERNETES, "autoscaling", "keda", "scaledobject.yaml"))
    out = [("keda", trigger["metadata"]["query"]) for trigger in keda["spec"]["triggers"]]
    adapter = load_yaml(os.path.join(KUBERNETES, "autoscaling", "hpa", "prometheus-adapter-values.yaml"))
    matchers = ",".join(f'{k}="{v}"' for k, v in ADAPTER_TEST_LABELS.items())
    for rule in adapter["rules"]["custom"]:
        out.append(("prometheus-adapter series", rule["seriesQuery"]))
        out.append(("prometheus-adapter metrics", rule["metricsQuery"]
                    .replace("<<.Series>>", rule["seriesQuery"].split("{")[0])
                    .replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod")))
    return out


def metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


def exported_names(metrics_text: str) -> set[str]:
    """The sample names a /metrics page can carry (a histogram's _bucket/_sum/_count, a counter's _total), its
    families read by prometheus-client's parser (families without samples yet count too)."""
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        if family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        elif family.type == "counter":
            names.add(family.name + "_total")
        else:
            names.add(family.name)
    return names


def recorded_names() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def unknown_metrics(exprs, exported: set[str]) -> dict[str, set[str]]:
    """{query: names it uses that are neither exported by the server, nor recorded by the rules, nor `up`}."""
    known = exported | recorded_names() | {"up"}
    out = {}
    for expr in exprs:
        missing = metric_names(expr) - known
        if missing:
            out[expr] = missing
    return out


def tool(name: str):
    """The path of a Prometheus tool, or None. .ci/run installs Debian's prometheus package and sets
    PAGEDSERVE_REQUIRE_PROMETHEUS, so CI fails instead of skipping when it is missing."""
    path = shutil.which(name)
    if path is None and os.environ.get("PAGEDSERVE_REQUIRE_PROMETHEUS"):
        raise AssertionError(f"{name} is not installed (apt-get install prometheus), but CI requires it")
    return path

