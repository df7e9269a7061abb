"""GET /openapi.json describes every route accurately (request bodies, 200 bodies, OpenAI's error body), needs
the API key like every route but /health, and schemathesis's stateless checks pass against a live server: no
5xx, every error OpenAI-shaped, every response as the schema says."""

from __future__ import annotations

import httpx
import pytest

from live_server import start_server

KEY = "openapi-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    live = start_server(tiny_llama_dir, "--api-key", KEY, "--max-num-seqs", "4")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def schema_doc(server) -> dict:
    r = httpx.get(server.url + "/openapi.json", headers=AUTH)
    assert r.status_code == 200
    return r.json()


def test_the_schema_needs_the_key(server):
    r = httpx.get(server.url + "/openapi.json")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_the_schema_lists_every_route_with_its_bodies(server, schema_doc):
    routes = {(route.path, method.lower()) for route in server.app.routes for method in getattr(route, "methods", ())
              if method != "HEAD" and route.path != "/openapi.json"}
    documented = {(path, method) for path, ops in schema_doc["paths"].items() for method in ops}
    assert documented == routes
    for path, ops in schema_doc["paths"].items():
        for method, op in ops.items():
            assert "default" in op["responses"] and "200" in op["responses"], (path, method)
            if method == "post" and path != "/reset_prefix_cache":
                assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"], path
            assert ("security" in op) == (path != "/health"), path
    completions = schema_doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(completions) == {"application/json", "text/event-stream"}
    assert "prompt" in schema_doc["components"]["schemas"]["CompletionRequest"]["required"]


@pytest.fixture(scope="module")
def api_schema(schema_doc):
    import schemathesis

    return schemathesis.openapi.from_dict(schema_doc)


def _cheap(body):
    """Generated bodies keep their shape, but not thousands of tokens to generate (two cores, many examples)."""
    if isinstance(body, dict):
        for field, most in (("n", 2), ("max_tokens", 4), ("max_completion_tokens", 4)):
            if isinstance(body.get(field), int) and not isinstance(body.get(field), bool) and body[field] > most:
                body[field] = most
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 4
    return body


def openai_error_bodies(ctx, response, case):
    """Every 4xx and 5xx body is OpenAI's error object."""
    if response.status_code >= 400:
        error = response.json().get("error")
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, response.text


def test_schemathesis_stateless_checks_pass(api_schema, server):
    """Each operation gets its examples (no shrinking: a failure is reported as found) and every check but
    positive_data_acceptance: a body the schema allows may still be refused (a prompt too long for the
    context, token ids outside the vocabulary), which no schema can say."""
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import positive_data_acceptance

    failures = []
    for result in api_schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=int(__import__("os").environ.get("OPENAPI_EXAMPLES", "15")), deadline=None, phases=[Phase.explicit, Phase.generate], database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case) -> None:
            if isinstance(case.body, dict):
                case.body = _cheap(case.body)
            case.call_and_validate(base_url=server.url, headers=AUTH, additional_checks=[openai_error_bodies],
                                   excluded_checks=[positive_data_acceptance])

        try:
            check()
        except Exception as e:  # noqa: BLE001 - collected: every operation is tried
            failures.append(f"{operation.label}: {e}"[:2000])
    assert not failures, "\n\n".join(failures)
