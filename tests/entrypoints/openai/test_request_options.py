"""Per-request options on a keyless fcfs server: X-Request-Id (given, generated, refused, duplicated) as the engine's
request id and in every response; `priority` refused by the fcfs policy."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from live_server import server  # noqa: F401 - fixture

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture
def engine_ids(server, monkeypatch):
    """The request ids AsyncLLM.generate is called with; a request whose id starts with "hold" stops after its
    first output with text (so that a streamed data line has gone out) until the returned event is set."""
    ids, release = [], threading.Event()
    original = server.async_llm.generate

    async def recording(prompt, params, request_id, **kwargs):
        ids.append(request_id)
        held = not request_id.startswith("hold")
        async for out in original(prompt, params, request_id, **kwargs):
            yield out
            if held or not any(c.text for c in out.outputs):
                continue  # a first token may be part of a character: its text is held back, no line is sent
            held = True
            while not release.is_set():
                await asyncio.sleep(0.005)

    monkeypatch.setattr(server.async_llm, "generate", recording)
    yield ids, release
    release.set()


def test_a_given_request_id_is_the_engine_id_and_comes_back(server, engine_ids):
    ids, _ = engine_ids
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                   headers={"X-Request-Id": "job-42:part.1_a"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "job-42:part.1_a"
    assert r.json()["id"] == "cmpl-job-42:part.1_a"
    chat = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "chat-7"})
    assert chat.json()["id"] == "chatcmpl-chat-7" and chat.headers["x-request-id"] == "chat-7"
    two = httpx.post(server.url + "/v1/completions", json={"prompt": ["Hi", "Yo"], "max_tokens": 2},
                     headers={"X-Request-Id": "multi"})
    assert two.json()["id"] == "cmpl-multi"
    assert ids == ["job-42:part.1_a", "chat-7", "multi-0", "multi-1"]


def test_a_generated_request_id_is_returned_on_every_response_errors_included(server, engine_ids):
    ids, _ = engine_ids
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    generated = r.headers["x-request-id"]
    assert r.json()["id"] == f"cmpl-{generated}" and ids == [generated]
    for response in (httpx.get(server.url + "/v1/models"), httpx.get(server.url + "/health"),
                     httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "temperature": -1}),
                     httpx.get(server.url + "/nowhere")):
        assert len(response.headers["x-request-id"]) == 32
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "temperature": -1},
                         headers={"X-Request-Id": "mine"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "mine"
    assert len({r.headers["x-request-id"] for r in (httpx.get(server.url + "/version") for _ in range(3))}) == 3


@pytest.mark.parametrize("bad", ["", "has space", "x" * 129, "semi;colon", "ünï"])
def test_a_malformed_request_id_is_400_naming_the_header(server, engine_ids, bad):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                   headers={"X-Request-Id": bad.encode()})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
    assert "x-request-id" not in r.headers and engine_ids[0] == []


def test_a_request_id_already_in_flight_is_400(server, engine_ids):
    ids, release = engine_ids
    # 240 tokens keep the engine busy (and the id taken) far longer than the second request takes to arrive.
    with httpx.stream("POST", server.url + "/v1/completions", headers={"X-Request-Id": "hold-1"}, timeout=60,
                      json={"prompt": "Hi", "max_tokens": 240, "ignore_eos": True, "stream": True}) as first:
        lines = first.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        again = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "hold-1"})
        error = again.json()["error"]
        assert again.status_code == 400 and error["param"] == "X-Request-Id" and "already in use" in error["message"]
        release.set()
        assert [line for line in lines if line.startswith("data:")][-1] == "data: [DONE]"
    assert ids == ["hold-1", "hold-1"]
    again = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "hold-1"})
    assert again.status_code == 200  # free again once the first has finished


def test_under_fcfs_an_explicit_priority_is_400_naming_priority(server):
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", CHAT)):
        r = httpx.post(server.url + path, json={**body, "max_tokens": 2, "priority": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
        assert httpx.post(server.url + path, json={**body, "max_tokens": 2, "priority": 0}).status_code == 200
