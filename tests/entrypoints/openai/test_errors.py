"""Every failure in OpenAI's error shape, with the right status: 400/404/413/401/429/405."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from live_server import MODEL_NAME, client, server, start_server  # noqa: F401 - fixtures
from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.openai.api_server import server_config


def assert_error(r: httpx.Response, status: int, param=None, contains: str = ""):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param, body
    assert contains in body["error"]["message"], body
    return body["error"]


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def test_malformed_json_and_schema_violations_are_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi",', timeout=30,
                   headers={"content-type": "application/json"})
    assert_error(r, 400, None, "not valid JSON")
    assert_error(httpx.post(server.url + "/v1/completions", content=b"[1, 2]", timeout=30), 400, None, "JSON object")
    assert_error(post(server, "/v1/completions", {"max_tokens": 3}), 400, "prompt", "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "n": "many"}), 400, "n")
    assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}), 400,
                 "messages")
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    assert_error(post(server, "/v1/completions", {"prompt": []}), 400, "prompt", "empty")
    assert_error(post(server, "/v1/completions", {"prompt": [1, 10**6]}), 400, "prompt", "token ids")


def test_sampling_params_errors_name_the_parameter(server, client):
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "temperature": -1}), 400, "temperature")
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "top_p": 2}), 400, "top_p")
    assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "presence_penalty": 5}), 400, "presence_penalty")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, top_p=0)
    assert e.value.status_code == 400 and e.value.param == "top_p"


def test_unknown_model_is_404(server, client):
    assert_error(post(server, "/v1/completions", {"model": "nope", "prompt": "hi"}), 404, "model", "nope")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_too_long_is_400_with_both_numbers(server):
    err = assert_error(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 300}), 400, "max_tokens")
    assert "256" in err["message"] and "300" in err["message"]
    err = assert_error(post(server, "/v1/completions", {"prompt": list(range(5, 261))}), 400, "max_tokens")
    assert "256 tokens" in err["message"] and "256 in the prompt" in err["message"]  # max_tokens omitted
    err = assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                             "max_completion_tokens": 1000}),
                       400, "max_completion_tokens")
    assert "1000" in err["message"] and "256" in err["message"]


def test_limits_on_n_logprobs_stop_are_400(server):
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "n": 129}), 400, "n")
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "n": 0}), 400, "n")
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "logprobs": 21}), 400, "logprobs", "max-logprobs")
    assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "logprobs": True, "top_logprobs": 21}), 400, "top_logprobs")
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "stop": ["s"] * 17}), 400, "stop")
    assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "response_format": {"type": "xml"}}),
                 400, "response_format")


def test_unknown_route_and_wrong_method(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.url + "/v1/completions"), 405)


def test_env_api_key(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--served-model-name", "m"])
    assert server_config(args).api_keys == ["from-env"]
    args = build_parser().parse_args(["serve", "--served-model-name", "m", "--api-key", "a", "--api-key", "b"])
    assert server_config(args).api_keys == ["a", "b"]


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir):
    live = start_server(tiny_llama_dir, "--api-key", "key-1", "--api-key", "key-2", "--max-num-seqs", "1",
                        "--max-num-queued-requests", "1", "--max-request-body-bytes", "4096")
    yield live
    live.stop()


ROUTES = [("GET", "/v1/models"), ("GET", "/version"), ("GET", "/metrics"), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/nowhere")]


@pytest.mark.parametrize("method,path", ROUTES)
def test_every_route_needs_the_key(guarded, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-1"}):
        r = httpx.request(method, guarded.url + path, json={}, headers=headers)
        assert_error(r, 401, None, "API key")
    r = httpx.request(method, guarded.url + path, json={"prompt": "hi", "max_tokens": 1, "tokens": [5],
                                                       "messages": [{"role": "user", "content": "x"}]},
                      headers={"Authorization": "Bearer key-2"})
    assert r.status_code != 401


def test_health_needs_no_key(guarded):
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_body_over_the_limit_is_413(guarded):
    auth = {"Authorization": "Bearer key-1"}
    big = {"prompt": "x" * 5000}
    assert_error(httpx.post(guarded.url + "/v1/completions", json=big, headers=auth), 413)

    def chunks():  # no Content-Length: counted while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    assert_error(httpx.post(guarded.url + "/v1/completions", content=chunks(), headers=auth), 413)


def test_queue_full_is_429_and_admitted_requests_finish(guarded):
    auth = {"Authorization": "Bearer key-1"}
    body = {"prompt": "Hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=guarded.url, headers=auth, timeout=60) as http:
        # The first runs long enough (the core steps on its own, in its own process) for the second to wait.
        long_tokens = getattr(guarded, "long_max_tokens", 200)
        with http.stream("POST", "/v1/completions", json={**body, "max_tokens": long_tokens, "stream": True}) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # running (max_num_seqs=1)
            second = {}
            t = threading.Thread(target=lambda: second.update(r=http.post("/v1/completions", json=body)))
            t.start()
            deadline = time.monotonic() + 10
            while guarded.async_llm.stats.num_waiting < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            r = http.post("/v1/completions", json=body)
            assert_error(r, 429, None, "max_num_queued_requests")
            assert r.headers["retry-after"] == "1"
            rest = [line for line in lines if line.startswith("data:")]
            assert rest[-1] == "data: [DONE]"
        t.join(30)
    assert second["r"].status_code == 200 and second["r"].json()["usage"]["completion_tokens"] == 40
    guarded.wait_idle()
