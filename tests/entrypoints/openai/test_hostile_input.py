"""Hostile input gets an OpenAI-shaped 400 in bounded time, never a 500, and the server keeps serving: lone
surrogates, JSON nested 10,000 deep, and a 10 MB prompt (refused by its length before it is tokenized)."""

from __future__ import annotations

import time

import httpx
import pytest

from live_server import MODEL_NAME, server  # noqa: F401 - fixture


def post_raw(server, path: str, body: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)


def assert_400(r: httpx.Response, param, contains: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert contains in error["message"], error


def still_serves(server) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "x\\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    assert_400(post_raw(server, path, body), param, "lone surrogate")
    still_serves(server)


def test_a_surrogate_pair_is_the_character_it_spells(server):
    r = post_raw(server, "/tokenize", b'{"prompt": "\\ud83d\\ude80"}')  # U+1F680, escaped as JSON allows
    assert r.status_code == 200 and r.json()["count"] > 0


def test_json_nested_10000_deep_is_a_400(server):
    deep = b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    assert_400(post_raw(server, "/v1/completions", deep), None, "nested too deeply")
    still_serves(server)


def test_a_10_mb_prompt_is_refused_by_its_length_before_tokenizing(server):
    start = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "Hello world " * 900_000, "max_tokens": 2})
    elapsed = time.monotonic() - start
    assert_400(r, "prompt", "characters long")
    assert elapsed < 3.0, elapsed  # tokenizing it whole took seconds
    still_serves(server)


def timed(fn):
    start = time.monotonic()
    result = fn()
    return result, time.monotonic() - start


@pytest.mark.parametrize("body,param,contains", [
    (b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}', "temperature", "finite"),
    (b'{"prompt": "x", "max_tokens": 2, "top_p": Infinity}', "top_p", "inf"),
    (b'{"prompt": "x", "max_tokens": 1e400}', "max_tokens", "valid integer"),  # a float, even 1e400
    (b'{"prompt": "x", "prompt": "y", "max_tokens": 2}', "prompt", "twice"),
    (b'{"prompt": "x", "logit_bias": {"5": 1, "5": 2}, "max_tokens": 2}', "5", "twice"),
])
def test_nan_infinity_and_duplicate_keys_are_400s(server, body, param, contains):
    assert_400(post_raw(server, "/v1/completions", body), param, contains)
    still_serves(server)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_says_it_is_not_json_is_a_400(server, content_type):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}',
                   headers={"content-type": content_type})
    assert_400(r, "Content-Type", "must be application/json")
    ok = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}',
                    headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


@pytest.mark.parametrize("body,param,contains", [
    ({"prompt": list(range(100)) * 10_000, "max_tokens": 2}, "max_tokens", "maximum context length"),
    ({"prompt": ["a"] * 1_000_000, "max_tokens": 2}, "prompt", "at most 2048 prompts"),
    ({"prompt": [-1, 5], "max_tokens": 2}, "prompt", "token ids must be in"),
    ({"prompt": [10 ** 12], "max_tokens": 2}, "prompt", "token ids must be in"),
    ({"prompt": "x", "max_tokens": 2, "logit_bias": {str(i): 1 for i in range(10_000)}}, "logit_bias", "vocabulary"),
    ({"prompt": "x", "n": 129, "max_tokens": 2}, "n", "between 1 and 128"),
    ({"prompt": "x", "max_tokens": 10 ** 30}, "max_tokens", "maximum context length"),
    ({"prompt": "x", "max_tokens": 2, "stop": ["a" * 5000]}, "stop", "at most 1024 characters"),
])
def test_oversized_arrays_and_out_of_range_values_are_400s_in_bounded_time(server, body, param, contains):
    r, seconds = timed(lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=60))
    assert_400(r, param, contains)
    assert seconds < 5, seconds
    still_serves(server)


def test_tokenizing_a_huge_batch_of_prompts_does_not_hold_the_event_loop(server):
    """1,000 prompts just under the character limit (about 10 MB of text, seconds of tokenizing): /health keeps
    answering meanwhile, because prompts are tokenized on the tokenizer thread, not on the event loop."""
    import threading

    from pagedserve.entrypoints.openai.serving_base import NORMALIZER_SLACK

    longest = max(len(t) for t in server.async_llm.input_processor.tokenizer.get_vocab())
    limit = NORMALIZER_SLACK * longest * server.async_llm.max_model_len
    words = "the quick brown fox jumps over the lazy dog "
    prompt = (words * (limit // len(words) + 1))[:limit - 1]
    result = {}

    def big_request() -> None:
        result["response"] = httpx.post(server.url + "/v1/completions", timeout=120,
                                        json={"prompt": [prompt] * 1000, "max_tokens": 1})

    thread = threading.Thread(target=big_request)
    thread.start()
    health_seconds = []
    while thread.is_alive():
        start = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        health_seconds.append(time.monotonic() - start)
        time.sleep(0.05)
    thread.join()
    assert result["response"].status_code == 400  # the prompts do not fit the context, once tokenized
    assert max(health_seconds) < 0.5, f"/health took up to {max(health_seconds):.2f} s"
    assert len(health_seconds) > 5, "the request was too quick to tell"
