"""A real Prometheus (Debian's package) scrapes a live server on the tiny model while requests run, with the
shipped scrape jobs and rule files: every dashboard query, every recording rule, every alert's expression and the
autoscalers' queries return data, and they name only metrics the server exports."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints", "openai"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lora"))

from deploy_files import (ADAPTER_TEST_LABELS, PROMETHEUS_DIR, RULE_FILES, alert_operands,  # noqa: E402
                          autoscaler_queries, dashboard_queries, exported_names, load_yaml, rules, tool,
                          unknown_metrics)
from live_server import free_port, start_server  # noqa: E402
from peft_adapters import make_adapter  # noqa: E402
from test_api_keys import tenant_toml  # noqa: E402

PROMETHEUS = tool("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="needs Prometheus (apt-get install prometheus); "
                                "CI installs it")
SCRAPE_KEY = "scrape-key"


def prometheus_config(server_port: int) -> dict:
    """The shipped prometheus.yml pointed at the live server, scraping every second with the key."""
    config = load_yaml(os.path.join(PROMETHEUS_DIR, "prometheus.yml"))
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = RULE_FILES
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [f"127.0.0.1:{server_port}"], "labels": ADAPTER_TEST_LABELS}]
        job["scrape_interval"] = "1s"
        if job["job_name"] == "pagedserve":
            job["authorization"] = {"credentials": SCRAPE_KEY}
    return config


@pytest.fixture(scope="module")
def live(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prometheus")
    keys = folder / "keys.toml"
    keys.write_text(tenant_toml("ops", SCRAPE_KEY, scope="admin") + tenant_toml("web", "web-key")
                    + tenant_toml("limited", "limited-key", requests_per_minute=1))
    adapter = make_adapter(tiny_llama_dir, str(folder / "adapter"), 1)
    server = start_server(tiny_llama_dir, "--api-keys-file", str(keys), "--enable-lora", "--max-lora-rank", "16",
                          "--lora-modules", f"sql={adapter}")
    port = free_port()
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(int(server.url.rsplit(":", 1)[1]))))
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        wait_for(lambda: scalar(api, 'sum(up{job=~"pagedserve|pagedserve-health"})') == 2, "both targets up", proc)
        run_traffic(server.url)
        server.wait_idle(30)
        # Let Prometheus scrape the idle server a few times and evaluate the rules on what it scraped.
        scrapes = scalar(api, 'count_over_time(up{job="pagedserve"}[5m])')
        wait_for(lambda: scalar(api, 'count_over_time(up{job="pagedserve"}[5m])') >= scrapes + 3, "more scrapes",
                 proc)
        yield {"api": api, "server": server}
    finally:
        proc.terminate()
        proc.wait(10)
        server.stop()


def scalar(api: str, expr: str) -> float:
    result = query(api, expr)
    return float(result[0]["value"][1]) if result else 0.0


def query(api: str, expr: str) -> list:
    reply = httpx.get(f"{api}/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def wait_for(condition, what: str, proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except (httpx.HTTPError, ValueError):
            pass  # Prometheus is still starting (no socket yet, or a plain-text 503 "Service Unavailable")
        assert proc.poll() is None, f"prometheus exited: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def run_traffic(url: str) -> None:
    """Two clients for ~4 s: completions and chat, streamed and not, n > 1, the LoRA adapter, a repeated prompt
    (prefix-cache hits), and the errors the error panels show (400, 401, 429)."""
    def bearer(key):
        return {"Authorization": f"Bearer {key}"}

    def client(seed: int) -> None:
        with httpx.Client(base_url=url, timeout=60, headers=bearer("web-key")) as http:
            end = time.monotonic() + 4
            i = seed
            while time.monotonic() < end:
                i += 1
                prompt = "The same long shared prefix of every request, " * 4 + str(i % 3)
                http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8 + i % 8, "n": 1 + i % 2,
                                                   "model": "sql" if i % 3 == 0 else None})
                with http.stream("POST", "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 6, "stream": True}) as r:
                    list(r.iter_lines())
                http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})  # 400
            http.get("/v1/models", headers=bearer("wrong"))  # 401
    threads = [threading.Thread(target=client, args=(seed,)) for seed in (0, 100)]
    for t in threads:
        t.start()
    for _ in range(2):  # the second one is over its 1 request per minute: 429
        httpx.post(url + "/v1/completions", headers=bearer("limited-key"), json={"prompt": "x", "max_tokens": 1},
                   timeout=60)
    for t in threads:
        t.join()


def assert_has_data(api: str, expr: str, what: str) -> None:
    result = query(api, expr)
    assert result, f"{what}: no data for {expr}"
    values = [float(sample["value"][1]) for sample in result]
    assert any(math.isfinite(v) for v in values), f"{what}: only NaN/Inf for {expr}: {values}"


@pytest.mark.parametrize("title, expr", dashboard_queries())
def test_every_dashboard_query_returns_data_after_traffic(live, title, expr):
    assert_has_data(live["api"], expr, f"panel {title!r}")


def test_every_rule_is_healthy_and_every_recording_rule_has_data(live):
    groups = httpx.get(live["api"] + "/rules", timeout=10).json()["data"]["groups"]
    loaded = {rule["name"]: rule for group in groups for rule in group["rules"]}
    for rule in rules():
        name = rule.get("record") or rule["alert"]
        assert loaded[name]["health"] == "ok", (name, loaded[name].get("lastError"))
        if "record" in rule:
            assert_has_data(live["api"], rule["record"], f"recording rule {name}")


def test_every_alert_expression_returns_data_without_its_threshold(live):
    for rule in rules():
        if "alert" in rule:
            for operand in alert_operands(rule["expr"]):
                assert query(live["api"], operand), f"alert {rule['alert']}: no data for {operand}"


@pytest.mark.parametrize("source, expr", autoscaler_queries())
def test_the_autoscalers_queries_return_data(live, source, expr):
    assert query(live["api"], expr), f"{source}: no data for {expr}"


def test_the_dashboard_rules_and_autoscalers_name_only_exported_metrics(live):
    text = httpx.get(live["server"].url + "/metrics", headers={"Authorization": f"Bearer {SCRAPE_KEY}"}).text
    exported = exported_names(text)
    exprs = ([e for _, e in dashboard_queries()] + [r["expr"] for r in rules()]
             + [e for _, e in autoscaler_queries()])
    assert unknown_metrics(exprs, exported) == {}
    # and the check does catch a name the server does not have
    assert unknown_metrics(["rate(pagedserve:no_such_metric_total[1m])"], exported) == {
        "rate(pagedserve:no_such_metric_total[1m])": {"pagedserve:no_such_metric_total"}}
