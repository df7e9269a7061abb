"""The engine failing under a live server, injected through POST /debug/inject_fault: requests in flight end at
once with a 503 (an SSE error event once streaming), /health turns 503, and with --restart-on-engine-failure the
engine comes back in the same server process, counted in pagedserve:engine_restarts_total, serving the same
greedy text as before."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from conftest import assert_no_leaked_blocks
from live_server import ENGINE_FLAGS, MODEL_NAME, ServeProcess, free_port, scrape, start_server, value

GREEDY = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def restarting(tiny_llama_dir):
    live = start_server(tiny_llama_dir, "--enable-fault-injection", restart_on_failure=True)
    yield live
    live.stop()


def wait_for_health(url: str, status: int, timeout: float = 60.0) -> float:
    start = time.monotonic()
    while httpx.get(url + "/health").status_code != status:
        assert time.monotonic() - start < timeout, f"/health never became {status}"
        time.sleep(0.05)
    return time.monotonic() - start


def start_long_stream(url: str, into: list) -> threading.Thread:
    """A 200-token greedy stream in a thread: its status, then its `data:` lines, go to `into`."""
    def run():
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={**GREEDY, "max_tokens": 200, "stream": True}) as r:
            into.append(r.status_code)
            into.extend(line for line in r.iter_lines() if line.startswith("data:"))
    thread = threading.Thread(target=run)
    thread.start()
    while len(into) < 3:  # the status and two chunks: it is running in the engine
        time.sleep(0.01)
    return thread


@pytest.mark.parametrize("fault", ["step_error", "kill"])
def test_a_failed_engine_fails_requests_in_flight_with_503_and_comes_back(restarting, fault):
    url = restarting.url
    before = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    lines: list = []
    stream = start_long_stream(url, lines)
    r = httpx.post(url + "/debug/inject_fault", json={"fault": fault})
    assert r.status_code == 200 and r.json() == {"fault": fault}
    stream.join(30)
    assert not stream.is_alive()
    assert lines[0] == 200 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == "engine_dead" and "died" in error["message"]
    down = httpx.get(url + "/health")
    refused = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60)
    # The restart may already be done by now: then the request is simply served.
    assert (down.status_code, refused.status_code) in ((503, 503), (200, 200), (503, 200))
    wait_for_health(url, 200)
    after = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    assert after == before
    assert value(scrape(restarting), "pagedserve:engine_restarts_total", model_name=MODEL_NAME) == 1
    assert_no_leaked_blocks(restarting.async_llm)


def test_a_step_error_fails_a_waiting_non_streaming_request_with_503(restarting):
    url = restarting.url
    httpx.post(url + "/debug/inject_fault", json={"fault": "step_error"})
    r = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    wait_for_health(url, 200)
    assert httpx.post(url + "/v1/completions", json=GREEDY, timeout=60).status_code == 200


def test_without_restart_the_engine_stays_down(tiny_llama_dir):
    live = start_server(tiny_llama_dir, "--enable-fault-injection")  # restart_on_failure=False: as LLM offline
    try:
        httpx.post(live.url + "/debug/inject_fault", json={"fault": "kill"})
        wait_for_health(live.url, 503)
        time.sleep(2)  # longer than the first restart backoff
        assert httpx.get(live.url + "/health").status_code == 503
        assert value(scrape(live), "pagedserve:engine_restarts_total", model_name=MODEL_NAME) == 0
    finally:
        live.stop()


def test_the_fault_route_is_absent_without_the_flag_and_refuses_a_bad_fault(tiny_llama_dir, restarting):
    assert httpx.post(restarting.url + "/debug/inject_fault", json={"fault": "boom"}).status_code == 400
    live = start_server(tiny_llama_dir)
    try:
        assert httpx.post(live.url + "/debug/inject_fault", json={"fault": "kill"}).status_code == 404
    finally:
        live.stop()


def test_serve_restarts_by_default_and_logs_it(tiny_llama_dir):
    port = free_port()
    server = ServeProcess("--model", tiny_llama_dir, "--port", str(port), "--enable-fault-injection", *ENGINE_FLAGS)
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_for_output("pagedserve is ready", timeout=120)
        assert httpx.post(url + "/debug/inject_fault", json={"fault": "kill"}).status_code == 200
        server.wait_for_output("engine core restarted (restart 1", timeout=60)
        assert httpx.post(url + "/v1/completions", json=GREEDY, timeout=60).status_code == 200
    finally:
        server.stop()
    assert server.proc.returncode == 0
