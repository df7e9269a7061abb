"""Structured output through the server: OpenAI's response_format (json_object, json_schema) and vLLM's
structured_outputs, streaming and not, on chat and completions; bad constraints are 400s naming the field,
and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from conftest import assert_no_leaked_blocks
from live_server import MODEL_NAME, client, server  # noqa: F401 - fixtures

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["city", "rank"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "A city and its rank, as JSON."}]


def response_format(schema=SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def test_chat_json_schema_validates_for_every_choice(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=3, temperature=1.0, seed=3,
                                         max_tokens=120, response_format=response_format())
    assert len(out.choices) == 3
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_deltas_concatenate_to_valid_json(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=5,
                                            max_tokens=120, response_format=response_format(), stream=True)
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_vllms_structured_outputs_on_both_routes(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=1,
                                         max_tokens=120, response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    choice = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=1.0, max_tokens=20,
                                            extra_body={"structured_outputs": {"choice": ["north", "south"]}})
    assert choice.choices[0].message.content in ("north", "south")
    completion = client.completions.create(model=MODEL_NAME, prompt="Code:", temperature=1.0, max_tokens=20,
                                           extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert len(completion.choices[0].text) == 6 and completion.choices[0].text[3] == "-"
    # The openai client's completions.create has no response_format: sent as a plain body.
    body = {"model": MODEL_NAME, "prompt": "JSON:", "temperature": 1.0, "seed": 2, "max_tokens": 120,
            "response_format": response_format()}
    r = httpx.post(f"{client.base_url}completions", json=body, timeout=30)
    assert r.status_code == 200
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)


@pytest.mark.parametrize("body, param, contains", [
    ({"response_format": response_format({"type": "array", "uniqueItems": True})}, "response_format", "uniqueItems"),
    ({"response_format": response_format({"type": "strnig"})}, "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "regex cannot be compiled"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", ""),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
])
def test_bad_constraints_are_400_naming_the_field_and_the_server_keeps_serving(server, body, param, contains):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, **body},
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and contains in error["message"], error
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3},
                    timeout=30)
    assert ok.status_code == 200
    server.wait_idle()
    assert_no_leaked_blocks(server.engine)


def test_logprobs_of_a_constrained_request_are_json_numbers(server):
    # The grammar bans most tokens (-inf); the response must still be JSON, so they are floored at -9999.
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, "logprobs": True, "top_logprobs": 5,
            "structured_outputs": {"choice": ["yes", "no"]}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["content"]
    assert tokens and all(t["logprob"] >= -9999 for t in tokens)
    assert min(top["logprob"] for t in tokens for top in t["top_logprobs"]) == -9999.0
