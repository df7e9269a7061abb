"""GET /openapi.json describes every route accurately (request bodies, 200 bodies and event streams, each error
status with OpenAI's error body), needs the API key like every route but /health, and schemathesis's stateless
checks pass against a live server: no 5xx, every error OpenAI-shaped, every response as the schema says."""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from live_server import start_server
from pagedserve.entrypoints.openai.api_server import OPEN_ROUTES, ROUTES
from pagedserve.entrypoints.openai.rate_limits import RATE_LIMITED_ROUTES

KEY = "openapi-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("PAGEDSERVE_OPENAPI_EXAMPLES", "30"))
"""Examples per path (valid and invalid requests); raise it to fuzz longer locally."""


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # The LoRA routes answer without --enable-lora (a 400 for a load, a 404 for an unload); the fault route
    # would kill the engine, so it is only documented (test_optional_routes...), never called.
    live = start_server(tiny_llama_dir, "--api-key", KEY, "--max-num-seqs", "4", "--allow-runtime-lora-updating",
                        "--max-model-len", "1024")  # the tool prompt is long in the tiny tokenizer
    yield live
    live.stop()


@pytest.fixture(scope="module")
def schema_doc(server) -> dict:
    r = httpx.get(server.url + "/openapi.json", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return r.json()


def _operations(app) -> set[tuple[str, str]]:
    """(path, method) of every route the app has, but the schema's own."""
    return {(route.path, method.lower()) for route in app.routes for method in getattr(route, "methods", ())
            if method != "HEAD" and route.path != app.openapi_url}


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if "$ref" in node else []) + [r for v in node.values() for r in _refs(v)]
    return [r for v in node for r in _refs(v)] if isinstance(node, list) else []


def test_the_schema_needs_the_key(server):
    r = httpx.get(server.url + "/openapi.json")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/openapi.json", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # the one open route


def test_the_schema_lists_every_route_with_its_bodies(server, schema_doc):
    schemathesis.openapi.from_dict(schema_doc).validate()  # a valid OpenAPI 3.1 document
    assert {(path, method) for path, ops in schema_doc["paths"].items() for method in ops} == _operations(server.app)
    components = schema_doc["components"]["schemas"]
    assert all(ref.removeprefix("#/components/schemas/") in components for ref in _refs(schema_doc))
    assert "$defs" not in str(schema_doc)
    for path, ops in schema_doc["paths"].items():
        for method, op in ops.items():
            responses = op["responses"]
            assert "200" in responses and "default" not in responses, (path, method)
            for status, response in responses.items():
                if status != "200":
                    assert response["content"] == {"application/json": {"schema": {
                        "$ref": "#/components/schemas/ErrorResponse"}}}, (path, status)
            if method == "post" and path != "/reset_prefix_cache":
                assert op["requestBody"]["required"]
                assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"], path
            assert ("security" in op) == (path not in OPEN_ROUTES) and ("401" in responses) == ("security" in op)
    completions = schema_doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(completions) == {"application/json", "text/event-stream"}
    assert "prompt" in components["CompletionRequest"]["required"]
    assert components["CompletionRequest"]["properties"]["n"]["maximum"] == 128


def test_optional_routes_and_security_follow_the_flags(tiny_llama_dir):
    """The fault route is documented only where it exists; without keys, no route asks for one."""
    live = start_server(tiny_llama_dir, "--enable-fault-injection")
    try:
        doc = httpx.get(live.url + "/openapi.json").json()
        assert {(p, m) for p, ops in doc["paths"].items() for m in ops} == _operations(live.app)
        assert "/debug/inject_fault" in doc["paths"] and "/v1/load_lora_adapter" not in doc["paths"]
        assert "securitySchemes" not in doc["components"]
        assert not any("security" in op or "401" in op["responses"] for ops in doc["paths"].values()
                       for op in ops.values())
    finally:
        live.stop()


@pytest.fixture(scope="module")
def api_schema(schema_doc):
    # The key as schemathesis's own auth: its negative cases may then leave it out (a 401), which a header
    # passed with each call would put back. Streams are read (and checked) whole, not their first 20 events.
    config = schemathesis.Config.from_dict({"auth": {"openapi": {"bearer": {"bearer": KEY}}},
                                            "max-stream-events": 1 << 20})
    return schemathesis.openapi.from_dict(schema_doc, config=config)


def _cheap(body: dict) -> dict:
    """The body, with its shape, but not hundreds of tokens to generate (two cores, many examples)."""
    body = dict(body)
    for field, most in (("n", 2), ("max_tokens", 4), ("max_completion_tokens", 4)):
        value = body.get(field)  # an int, or a float like 73.0 (an integer to JSON schema and to pydantic)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > most:
            body[field] = most
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 4:
        body["prompt"] = body["prompt"][:4]
    return body


def openai_shaped(ctx, response, case):
    """Every 4xx and 5xx body is OpenAI's error object (also where the schema cannot say so: the 404s and 405s
    of the unknown paths and methods that schemathesis tries too); every stream ends in [DONE]."""
    content_type = response.headers.get("content-type", [""])[0]  # schemathesis: name -> list of values
    if response.status_code >= 400:
        assert content_type == "application/json", response.headers
        error = response.json().get("error")
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, response.text
        assert isinstance(error["message"], str) and isinstance(error["type"], str), response.text
    elif content_type.startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n"), response.text[-500:]



TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"u": {"enum": ["c"]}}, "required": ["u"], "additionalProperties": False}}}
TOOL_CALL = {"tools": [TOOL], "tool_choice": "required", "temperature": 0, "max_tokens": 150}
"""The grammar makes the call; 150 tokens are enough for it (and its whitespace)."""
CHAT = [{"role": "user", "content": "Hi"}]
SHAPES = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 3}),
    ("/v1/completions", {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3, "n": 2, "logprobs": 2,
                         "return_token_ids": True, "stop": ["e", "o"]}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "echo": True, "logit_bias": {"40": 100},
                         "stop_token_ids": [40]}),
    ("/v1/completions", {"prompt": ["Hello", "Hi"], "max_tokens": 3, "n": 2, "stream": True, "logprobs": 2,
                         "return_token_ids": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
                              "return_token_ids": True, "n": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 3, "stream": True, "logprobs": True,
                              "top_logprobs": 2, "return_token_ids": True, "n": 2,
                              "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": CHAT, **TOOL_CALL}),
    ("/v1/chat/completions", {"messages": CHAT, **TOOL_CALL, "stream": True}),
    ("/tokenize", {"messages": CHAT}),
    ("/tokenize", {"prompt": "Hello", "add_special_tokens": False}),
    ("/detokenize", {"tokens": [5, 6, 7]}),
]
"""Valid requests for the response shapes that random bodies seldom reach: streams, logprobs, token ids, n > 1,
several prompts, stop reasons, tool calls."""


@pytest.mark.parametrize("path, body", SHAPES)
def test_every_response_shape_conforms(api_schema, server, path, body):
    case = api_schema[path]["POST"].Case(body=body)
    response = case.call_and_validate(base_url=server.url, headers=AUTH, timeout=60,
                                      additional_checks=[openai_shaped])
    assert response.status_code == 200, response.text
    if "tools" in body:
        assert "tool_calls" in response.text, response.text


def test_the_documented_bounds_hold(server):
    """A top_k past int64 (what the schema's maximum says) is a 400: it used to kill the engine core."""
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "Hello", "max_tokens": 2, "top_k": 2**63})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
    assert server.async_llm.is_alive()
    ok = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                    json={"prompt": "Hello", "max_tokens": 2, "top_k": 2**63 - 1})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", [p for p in ROUTES if p not in ("/openapi.json", "/debug/inject_fault")])
def test_schemathesis_stateless_checks_pass(server, api_schema, path):
    """Each of the path's operations gets EXAMPLES requests, valid and invalid ones (no shrinking: a failure is
    reported as found), and every check but positive_data_acceptance: a body the schema allows may still be
    refused (a prompt too long for the context, a regex that does not compile, a priority under the fcfs
    policy), which no schema can say."""
    operations = api_schema[path]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operations.as_strategy(GenerationMode.POSITIVE) | operations.as_strategy(GenerationMode.NEGATIVE))
    def check(case) -> None:
        if path in RATE_LIMITED_ROUTES and isinstance(case.body, dict):
            case.body = _cheap(case.body)  # assigned, not edited in place: schemathesis then revalidates the case
        case.call_and_validate(base_url=server.url, timeout=60, additional_checks=[openai_shaped],
                               excluded_checks=[positive_data_acceptance])

    check()
