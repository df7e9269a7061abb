"""The Prometheus and Grafana files as files: promtool accepts the config and rules and passes the alerts' unit
tests; the dashboard is build_dashboard.py's output; every query names only metrics the server's registry has."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest

from deploy_files import (DASHBOARD, DEPLOY, PROMETHEUS_DIR, RULE_FILES, autoscaler_queries, dashboard_queries,
                          exported_names, rules, tool, unknown_metrics)
from pagedserve.metrics.prometheus import PrometheusStatLogger

PROMTOOL = tool("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (apt-get install prometheus); CI "
                                    "installs it")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=PROMETHEUS_DIR)


@needs_promtool
def test_promtool_accepts_the_scrape_config():
    done = promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_promtool_accepts_the_rule_files():
    done = promtool("check", "rules", *RULE_FILES)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_every_alert_passes_its_promtool_unit_test():
    done = promtool("test", "rules", os.path.join("tests", "pagedserve-alerts.test.yml"))
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    with open(os.path.join(PROMETHEUS_DIR, "tests", "pagedserve-alerts.test.yml"), encoding="utf-8") as f:
        tested = f.read()
    for rule in rules():
        if "alert" in rule:
            assert f"alertname: {rule['alert']}" in tested, f"{rule['alert']} has no unit test"


def test_the_dashboard_json_is_the_output_of_build_dashboard():
    spec = importlib.util.spec_from_file_location("build_dashboard", os.path.join(DEPLOY, "grafana",
                                                                                  "build_dashboard.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(DASHBOARD, encoding="utf-8") as f:
        assert f.read() == module.render(), "run python deploy/grafana/build_dashboard.py"


def test_every_panel_has_a_unique_title_and_a_query():
    with open(DASHBOARD, encoding="utf-8") as f:
        panels = [p for p in json.load(f)["panels"] if p["type"] != "row"]
    assert len({p["title"] for p in panels}) == len(panels)
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in panels)


def test_queries_name_only_metrics_the_servers_registry_has():
    """The registry a server builds (with LoRA on, so that its metrics are there too)."""
    exported = exported_names(PrometheusStatLogger("m", max_loras=1).render().decode())
    exprs = ([e for _, e in dashboard_queries()] + [r["expr"] for r in rules()]
             + [e for _, e in autoscaler_queries()])
    assert unknown_metrics(exprs, exported) == {}
    assert unknown_metrics(["sum(pagedserve:num_requests_waitin)"], exported) == {
        "sum(pagedserve:num_requests_waitin)": {"pagedserve:num_requests_waitin"}}
