"""/metrics, client disconnects (streaming and not), /health when the engine is dead, graceful shutdown."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import assert_no_leaked_blocks
from live_server import MODEL_NAME, ENGINE_FLAGS, client, server, stream_across_signal  # noqa: F401 - fixtures
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.openai.api_server import build_app

ENGINE_METRICS = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
                  "generation_tokens", "request_success", "num_preemptions", "time_to_first_token_seconds",
                  "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                  "request_prompt_tokens", "request_generation_tokens"]


def scrape(server) -> dict:
    """{(sample name, frozen labels): value}, parsed by prometheus_client's own parser."""
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_parse_and_move_as_requests_complete(server, client):
    before = scrape(server)
    families = {name for name, _ in before}
    for suffix in ENGINE_METRICS:
        assert any(name.startswith(f"pagedserve:{suffix}") for name in families), suffix
    label = {"model_name": MODEL_NAME}
    r = client.completions.create(model=MODEL_NAME, prompt="Hello, world.", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                   temperature=0, stop=None, extra_body={"ignore_eos": True})
    after = scrape(server)
    assert value(after, "pagedserve:request_success_total", finished_reason="length", **label) == \
        value(before, "pagedserve:request_success_total", finished_reason="length", **label) + 2
    assert value(after, "pagedserve:generation_tokens_total", **label) - \
        value(before, "pagedserve:generation_tokens_total", **label) == 8
    assert value(after, "pagedserve:prompt_tokens_total", **label) - \
        value(before, "pagedserve:prompt_tokens_total", **label) >= r.usage.prompt_tokens + 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        name = f"pagedserve:{hist}_count"
        assert value(after, name, **label) == value(before, name, **label) + 2, hist
    assert value(after, "pagedserve:inter_token_latency_seconds_count", **label) - \
        value(before, "pagedserve:inter_token_latency_seconds_count", **label) == 4 + 2
    assert value(after, "pagedserve:num_requests_running", **label) == 0
    assert value(after, "http_requests_total", handler="/v1/completions", method="POST", status="200") == \
        value(before, "http_requests_total", handler="/v1/completions", method="POST", status="200") + 1
    assert value(after, "http_requests_total", handler="/metrics", method="GET", status="200") >= 1


def raw_request(server, path: str, body: dict) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_running(server, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.async_llm.stats.num_running < 1:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.002)


LONG = {"prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {**LONG, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **LONG, "stream": True, "n": 2}),
    ("/v1/completions", LONG),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **LONG}),
])
def test_disconnect_aborts_within_a_second(server, path, body):
    finished_before = server.async_llm.stats.num_running, scrape(server)
    sock = raw_request(server, path, body)
    if body.get("stream"):
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # headers, and the stream has begun
    wait_running(server)
    sock.close()
    assert server.wait_idle(timeout=1.0) < 1.0
    assert_no_leaked_blocks(server.engine)
    after = scrape(server)
    assert value(after, "pagedserve:num_requests_running", model_name=MODEL_NAME) == 0
    assert value(after, "pagedserve:kv_cache_usage_perc", model_name=MODEL_NAME) == 0
    # aborted, not run to the end
    assert value(after, "pagedserve:request_success_total", model_name=MODEL_NAME, finished_reason="length") == \
        value(finished_before[1], "pagedserve:request_success_total", model_name=MODEL_NAME, finished_reason="length")


def test_health_is_503_and_requests_fail_when_the_engine_is_dead(tiny_llama_dir):
    from starlette.testclient import TestClient

    args = build_parser().parse_args(["serve", "--model", tiny_llama_dir, "--served-model-name", "m", *ENGINE_FLAGS])
    async_llm = AsyncLLM.from_kwargs(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22,
                                     max_model_len=256)
    app = build_app(async_llm, args)
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        async_llm.shutdown()
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_killed_engine_core_ends_streams_with_503_and_health_turns_503(tiny_llama_dir):
    from live_server import start_server

    live = start_server(tiny_llama_dir)
    try:
        with httpx.stream("POST", live.url + "/v1/completions", timeout=30,
                          json={"prompt": "Hello", "max_tokens": 250, "temperature": 0, "ignore_eos": True,
                                "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            os.kill(live.async_llm._client.process.pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == "engine_dead" and "died" in error["message"]
        health = httpx.get(live.url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert not live.async_llm.has_unfinished_requests()
    finally:
        live.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_graceful_shutdown_finishes_in_flight_requests_and_exits_0(tiny_llama_dir, sig):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--model", tiny_llama_dir,
                             "--port", str(port), *ENGINE_FLAGS], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        lines = stream_across_signal(proc, url, sig)
        assert lines[-1] == "data: [DONE]"
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length" and text
        assert proc.wait(30) == 0
        out = proc.stdout.read().decode()
        assert "pagedserve is ready: http://127.0.0.1:%d/v1" % port in out
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
