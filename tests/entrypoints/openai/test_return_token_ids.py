"""vLLM's `return_token_ids`: the generated ids of each choice (and the prompt's ids), whole or chunk by chunk,
equal to what the engine generated and to the usage counts."""

from __future__ import annotations

import json

import httpx

from live_server import server  # noqa: F401 - fixture

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True}


def _events(r: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completion_token_ids_are_the_engines_and_match_usage_and_the_text(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello, world", "n": 2, **GREEDY}, timeout=60)
    body = r.json()
    prompt_ids = server.async_llm.input_processor.tokenizer.encode("Hello, world")
    tokenizer = server.async_llm.input_processor.tokenizer
    for choice in body["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids
        assert len(choice["token_ids"]) == 12 and tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
    assert body["usage"]["completion_tokens"] == 24
    plain = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello, world"}, timeout=60).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_streamed_completion_chunks_carry_each_id_once_in_order(server):
    whole = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello, world", **GREEDY}, timeout=60).json()
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": "Hello, world", "stream": True, "stream_options": {"include_usage": True},
                         **GREEDY})
    events = _events(r)
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert chunks[0]["prompt_token_ids"] == whole["choices"][0]["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    ids = [t for c in chunks for t in c["token_ids"]]
    assert ids == whole["choices"][0]["token_ids"] and events[-1]["usage"]["completion_tokens"] == len(ids)


def test_chat_token_ids_whole_and_streamed_agree_with_usage(server):
    chat = {"messages": [{"role": "user", "content": "Hi there"}], "n": 2, **GREEDY}
    whole = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert whole["prompt_token_ids"] and whole["usage"]["prompt_tokens"] == len(whole["prompt_token_ids"])
    assert [len(c["token_ids"]) for c in whole["choices"]] == [12, 12]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={**chat, "stream": True, "stream_options": {"include_usage": True}})
    events = _events(r)
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:])
    for index in (0, 1):
        ids = [t for e in events for c in e["choices"] if c["index"] == index for t in c["token_ids"]]
        assert ids == whole["choices"][index]["token_ids"]
    assert events[-1]["usage"]["completion_tokens"] == 24


def test_stream_interval_sends_the_first_token_then_chunks_of_that_many(server):
    whole = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello, world", **GREEDY}, timeout=60).json()
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": "Hello, world", "stream": True, "stream_interval": 5,
                         "stream_options": {"include_usage": True}, **GREEDY})
    events = _events(r)
    chunks = [e["choices"][0]["token_ids"] for e in events if e["choices"]]
    assert [t for c in chunks for t in c] == whole["choices"][0]["token_ids"]
    # Outputs go out after tokens 1, 6, 11 and 12; a handler slower than the tiny model may take two at once.
    ends = [sum(len(c) for c in chunks[:i + 1]) for i in range(len(chunks))]
    assert set(ends) <= {1, 6, 11, 12} and ends[-1] == 12
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == whole["choices"][0]["text"] and events[-1]["usage"]["completion_tokens"] == 12


def test_a_stream_interval_below_one_is_400_naming_it(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": "Hello", "stream": True, "stream_interval": 0, "max_tokens": 2})
    assert r.status_code == 400 and "stream_interval" in r.json()["error"]["message"]
