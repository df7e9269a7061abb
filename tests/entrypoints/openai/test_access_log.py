"""The server's access log: one line per request once its response is over, with the counts and times a log
pipeline needs, prompt text only with --log-prompts, and every line of `--log-format json` a JSON object."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from live_server import ENGINE_FLAGS, MODEL_NAME, ServeProcess, free_port, start_server

PROMPT = "A distinctive prompt about zebras"


@pytest.fixture(scope="module")
def logged(tiny_llama_dir):
    live = start_server(tiny_llama_dir, log_requests=True)
    yield live
    live.stop()


def access_records(caplog, request_id: str, timeout: float = 5.0) -> list[logging.LogRecord]:
    """The access-log records of one request (its line is written just after the response went out)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in caplog.records if r.name == "pagedserve.requests" and r.fields["request_id"] == request_id]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def test_a_completion_logs_tenant_model_tokens_times_finish_reason_and_status_without_its_text(logged, caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
        r = httpx.post(logged.url + "/v1/completions", headers={"X-Request-Id": "log-1"}, timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "temperature": 0})
        [rec] = access_records(caplog, "log-1")
    usage, fields = r.json()["usage"], rec.fields
    assert {k: fields[k] for k in ("tenant", "model", "lora_adapter", "status", "finish_reason", "stream", "path")} \
        == {"tenant": "default", "model": MODEL_NAME, "lora_adapter": None, "status": 200, "finish_reason": "length",
            "stream": False, "path": "/v1/completions"}
    assert (fields["prompt_tokens"], fields["completion_tokens"]) == (usage["prompt_tokens"], 4)
    assert 0 < fields["ttft_s"] <= fields["e2e_s"] < 60
    assert "zebras" not in caplog.text and "prompt" not in fields


def test_a_streamed_chat_with_n_2_counts_both_choices(logged, caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
        with httpx.stream("POST", logged.url + "/v1/chat/completions", headers={"X-Request-Id": "log-2"},
                          timeout=60, json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3,
                                            "n": 2, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200 and list(r.iter_lines())
        [rec] = access_records(caplog, "log-2")
    assert rec.fields["stream"] is True and rec.fields["completion_tokens"] == 6
    assert rec.fields["finish_reason"] == "length"


def test_several_prompts_with_n_2_log_each_choices_finish_reason_in_order(logged, caplog):
    prompts = [PROMPT, "Short"]
    with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
        r = httpx.post(logged.url + "/v1/completions", headers={"X-Request-Id": "log-9"}, timeout=60,
                       json={"prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0, "stop": ["zz"],
                             "ignore_eos": True})
        [rec] = access_records(caplog, "log-9")
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert rec.fields["finish_reason"] == "length" and len(choices) == 4
    assert rec.fields["completion_tokens"] == r.json()["usage"]["completion_tokens"] == 20


def test_a_refused_request_is_logged_with_its_status_and_probes_are_not(logged, caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
        bad = httpx.post(logged.url + "/v1/completions", headers={"X-Request-Id": "log-3"},
                         json={"prompt": "x", "max_tokens": -1})
        httpx.get(logged.url + "/health", headers={"X-Request-Id": "log-4"})
        httpx.get(logged.url + "/metrics", headers={"X-Request-Id": "log-5"})
        [rec] = access_records(caplog, "log-3")
        assert not access_records(caplog, "log-4", 0.2) and not access_records(caplog, "log-5", 0)
    assert bad.status_code == 400 and rec.fields["status"] == 400 and "model" not in rec.fields


def test_a_client_that_leaves_mid_stream_is_logged_as_abort(logged, caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
        with httpx.stream("POST", logged.url + "/v1/completions", headers={"X-Request-Id": "log-6"}, timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data:"))
        [rec] = access_records(caplog, "log-6", timeout=10)
    assert rec.fields["finish_reason"] == "abort" and 0 < rec.fields["completion_tokens"] < 200
    logged.wait_idle()


def test_log_prompts_puts_the_prompt_and_completion_in_the_line_clipped_to_max_log_len(tiny_llama_dir, caplog):
    live = start_server(tiny_llama_dir, "--log-prompts", "--max-log-len", "12", log_requests=True)
    try:
        with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
            r = httpx.post(live.url + "/v1/completions", headers={"X-Request-Id": "log-7"}, timeout=60,
                           json={"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0})
            [rec] = access_records(caplog, "log-7")
    finally:
        live.stop()
    assert rec.fields["prompt"] == [PROMPT[:12]]
    assert rec.fields["completion"] == [r.json()["choices"][0]["text"][:12]]


def test_disable_log_requests_writes_no_access_log(tiny_llama_dir, caplog):
    live = start_server(tiny_llama_dir)  # --disable-log-requests
    try:
        with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
            httpx.post(live.url + "/v1/completions", headers={"X-Request-Id": "log-8"}, timeout=60,
                       json={"prompt": "x", "max_tokens": 1})
            assert not access_records(caplog, "log-8", 0.3)
    finally:
        live.stop()


def test_serve_log_format_json_writes_only_json_lines_with_the_request_fields_and_no_prompt(tiny_llama_dir):
    port = free_port()
    server = ServeProcess("--model", tiny_llama_dir, "--served-model-name", MODEL_NAME, "--port", str(port),
                          "--log-format", "json", *ENGINE_FLAGS)
    try:
        server.wait_for_output("pagedserve is ready", timeout=120)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"X-Request-Id": "json-1"},
                       timeout=60, json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3})
        assert r.status_code == 200
        server.wait_for_output('"request_id": "json-1"')
    finally:
        server.stop()
    assert server.proc.returncode == 0
    lines = [json.loads(line) for line in server.lines if line.strip()]  # every line parses
    [request] = [line for line in lines if line.get("request_id") == "json-1"]
    for name in ("time", "level", "logger", "tenant", "model", "prompt_tokens", "completion_tokens", "ttft_s",
                 "e2e_s", "finish_reason", "status"):
        assert name in request, name
    assert request["completion_tokens"] == r.json()["usage"]["completion_tokens"]
    assert not any("zebras" in json.dumps(line) for line in lines)
    assert any(line["message"] == "pagedserve stopped" for line in lines)
