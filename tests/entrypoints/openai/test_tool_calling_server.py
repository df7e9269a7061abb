"""Tool calling through the openai client on the tiny random model: the grammar alone makes calls valid.
required, a named function and auto (with --enable-auto-tool-choice), streaming and not; arguments validate
against each tool's parameters; a conversation with a tool result renders and runs; bad tools are 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from conftest import assert_no_leaked_blocks
from live_server import MODEL_NAME, start_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                 "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    live = start_server(tiny_llama_dir, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--max-model-len", "1024")  # the tool prompt is long in the tiny tokenizer
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def assert_valid_calls(calls, names=None) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(4))
def test_required_gives_valid_calls_and_finish_reason_tool_calls(client, seed):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         temperature=1.0, seed=seed, max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message.tool_calls)


def test_a_named_function_gives_exactly_one_call_of_it(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=1,
                                         max_tokens=200,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    assert_valid_calls(calls)


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in range(3):
        out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, seed=seed,
                                             tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                             max_tokens=200)
        assert len(out.choices[0].message.tool_calls) == 1


def test_streamed_tool_call_deltas_rebuild_the_calls(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=2, max_tokens=200, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None and delta.function.name  # id, type and name come first
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_auto_gives_text_or_valid_calls(client):
    called = 0
    for seed in range(6):
        out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=1.0,
                                             seed=seed, max_tokens=60)
        message = out.choices[0].message
        if message.tool_calls:
            called += 1
            assert out.choices[0].finish_reason == "tool_calls"
            assert_valid_calls(message.tool_calls)
        else:
            assert message.content is not None
    # (That a call the model starts is completed under the grammar: tests/tool_calling/test_constraint.py.)


def test_a_conversation_with_a_tool_result_renders_and_runs(client, server):
    first = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=10)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": history}).json()
    assert tokens["count"] > 0
    server.wait_idle()
    assert_no_leaked_blocks(server.engine)


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["x"]}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400_with_param_and_the_server_keeps_serving(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_auto_without_the_flag_is_a_400_naming_it(tiny_llama_dir):
    live = start_server(tiny_llama_dir, "--max-model-len", "1024")
    try:
        r = httpx.post(f"{live.url}/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                                "tools": TOOLS})
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
        ok = httpx.post(f"{live.url}/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                                 "tools": TOOLS, "tool_choice": "required",
                                                                 "max_tokens": 200})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"]
    finally:
        live.stop()
