"""A keys file on the live server: scopes and admin routes, tenants in logs and metrics, priorities by tenant,
prefix-cache isolation by tenant, and reloads (app.state.reload_keys, what SIGHUP calls) while a stream runs."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import threading

import httpx
import pytest

from live_server import MODEL_NAME, scrape, start_server, value
from pagedserve.entrypoints.openai.api_server import tenant_store
from pagedserve.entrypoints.openai.serving_base import ServerConfig
from pagedserve.tenants.tenant import hash_key

PROMPT = list(range(30, 80))  # 50 tokens: 3 full blocks of 16 can come from the cache
LONG = {"prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}


def tenant_toml(name: str, key: str, **fields) -> str:
    lines = [f"[tenants.{name}]", f'key_sha256 = "{hash_key(key)}"', *(f"{k} = {json.dumps(v)}"
                                                                       for k, v in fields.items())]
    return "\n".join(lines) + "\n\n"


KEYS = (tenant_toml("ops", "ops-key", scope="admin") + tenant_toml("web", "web-key", priority=5, min_priority=2)
        + tenant_toml("batch", "batch-key"))


@pytest.fixture(scope="module")
def keys_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def keyed(tiny_llama_dir, keys_path):
    live = start_server(tiny_llama_dir, "--api-keys-file", str(keys_path), "--api-key", "cli-key",
                        "--scheduling-policy", "priority", log_requests=True)
    yield live
    live.stop()


@pytest.fixture
def reloadable(keyed, keys_path):
    """The keys file, put back as it was (and reloaded) after the test."""
    yield keys_path
    keys_path.write_text(KEYS)
    assert keyed.app.state.reload_keys()


@pytest.fixture
def generate_calls(keyed, monkeypatch):
    """The keyword arguments (priority, tenant) of every AsyncLLM.generate call."""
    calls = []
    original = keyed.async_llm.generate

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(keyed.async_llm, "generate", recording)
    return calls


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def complete(server, key: str, **body) -> httpx.Response:
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0, **body}
    return httpx.post(server.url + "/v1/completions", json=body, headers=bearer(key), timeout=60)


def assert_error(r: httpx.Response, status: int, code=None, param=None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and (error["code"], error["param"]) == (code, param)
    return error


def test_user_keys_get_403_on_admin_routes_and_admin_keys_pass(keyed):
    r = httpx.post(keyed.url + "/reset_prefix_cache", headers=bearer("web-key"))
    error = assert_error(r, 403, "permission_denied")
    assert "admin" in error["message"] and error["type"] == "invalid_request_error"
    assert_error(httpx.post(keyed.url + "/reset_prefix_cache", headers=bearer("nope")), 401, "invalid_api_key")
    for admin in ("ops-key", "cli-key"):
        assert httpx.post(keyed.url + "/reset_prefix_cache", headers=bearer(admin)).status_code == 200
    assert httpx.get(keyed.url + "/v1/models", headers=bearer("web-key")).status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert_error(httpx.get(keyed.url + "/v1/models"), 401, "invalid_api_key")


def cached_tokens(server, key: str, **extra) -> int:
    r = complete(server, key, prompt=PROMPT, max_tokens=1, **extra)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_reset_prefix_cache_forgets_cached_prompts(keyed):
    cached_tokens(keyed, "ops-key")
    assert cached_tokens(keyed, "ops-key") == 48
    keyed.wait_idle()
    assert httpx.post(keyed.url + "/reset_prefix_cache", headers=bearer("ops-key")).status_code == 200
    assert cached_tokens(keyed, "ops-key") == 0


def test_reset_prefix_cache_is_409_when_the_engine_refuses(keyed, monkeypatch):
    monkeypatch.setattr(keyed.async_llm, "reset_prefix_cache", lambda: False)  # requests hold blocks
    r = httpx.post(keyed.url + "/reset_prefix_cache", headers=bearer("ops-key"))
    assert "running requests hold" in assert_error(r, 409, "prefix_cache_in_use")["message"]


def test_tenants_never_share_cached_blocks(keyed):
    assert cached_tokens(keyed, "web-key", cache_salt="t") == 0
    assert cached_tokens(keyed, "web-key", cache_salt="t") == 48
    assert cached_tokens(keyed, "batch-key", cache_salt="t") == 0  # same prompt and salt, other tenant


def test_the_tenant_name_not_the_key_is_in_the_request_log_and_the_metrics(keyed, caplog):
    before = scrape(keyed, bearer("ops-key"))
    with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
        r = complete(keyed, "batch-key", max_tokens=3, ignore_eos=True)
        chat = httpx.post(keyed.url + "/v1/chat/completions", headers={**bearer("batch-key"), "X-Request-Id": "c-1"},
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, timeout=60)
        lines = wait_for_log_lines(caplog, "tenant=batch", 2)
    assert r.status_code == chat.status_code == 200
    assert lines[1].startswith("POST /v1/chat/completions 200 request_id=c-1 ")
    assert r.headers["x-request-id"] in lines[0]
    assert "batch-key" not in caplog.text
    after = scrape(keyed, bearer("ops-key"))
    labels = {"model_name": MODEL_NAME, "tenant": "batch"}

    def delta(name, **extra):
        return value(after, name, **labels, **extra) - value(before, name, **labels, **extra)

    assert delta("pagedserve:tenant_requests_total", status="200") == 2
    usage, chat_usage = r.json()["usage"], chat.json()["usage"]
    assert delta("pagedserve:tenant_prompt_tokens_total") == usage["prompt_tokens"] + chat_usage["prompt_tokens"]
    assert delta("pagedserve:tenant_generation_tokens_total") == \
        usage["completion_tokens"] + chat_usage["completion_tokens"]


def test_priority_defaults_to_the_tenants_and_user_keys_cannot_ask_for_better(keyed, generate_calls):
    assert complete(keyed, "web-key").status_code == 200  # web's default: 5
    assert complete(keyed, "web-key", priority=2).status_code == 200  # its min_priority
    assert_error(complete(keyed, "web-key", priority=1), 400, param="priority")
    assert complete(keyed, "batch-key", priority=7).status_code == 200  # worse than its own: always allowed
    assert complete(keyed, "ops-key", priority=-10).status_code == 200  # admins may ask anything
    chat = httpx.post(keyed.url + "/v1/chat/completions", headers=bearer("cli-key"), timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": -3})
    assert chat.status_code == 200
    assert [(c["priority"], c["tenant"]) for c in generate_calls] == [
        (5, "web"), (2, "web"), (7, "batch"), (-10, "ops"), (-3, "default")]


@pytest.fixture
def held_after_first_output(keyed, monkeypatch):
    """web's requests stop after their first output until the returned event is set: a stream stays in
    flight for as long as the test needs, however fast the engine is."""
    release = threading.Event()
    original = keyed.async_llm.generate

    async def holding(*args, **kwargs):
        first = True
        async for out in original(*args, **kwargs):
            yield out
            while first and kwargs.get("tenant") == "web" and not release.is_set():
                await asyncio.sleep(0.005)
            first = False

    monkeypatch.setattr(keyed.async_llm, "generate", holding)
    yield release
    release.set()


def test_reload_adds_and_removes_keys_while_a_stream_is_in_flight(keyed, reloadable, held_after_first_output):
    with httpx.stream("POST", keyed.url + "/v1/completions", json=LONG, headers=bearer("web-key"),
                      timeout=60) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        reloadable.write_text(tenant_toml("ops", "ops-key", scope="admin") + tenant_toml("fresh", "fresh-key"))
        assert keyed.app.state.reload_keys() is True
        assert complete(keyed, "fresh-key").status_code == 200
        assert_error(complete(keyed, "web-key"), 401, "invalid_api_key")
        assert_error(complete(keyed, "batch-key"), 401, "invalid_api_key")
        assert complete(keyed, "cli-key").status_code == 200  # --api-key keys stay
        held_after_first_output.set()  # the stream admitted under the old keys goes on
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_a_bad_file_on_reload_keeps_the_old_keys(keyed, reloadable, caplog):
    reloadable.write_text(KEYS + tenant_toml("late", "late-key", scope="root"))
    with caplog.at_level(logging.ERROR, logger="pagedserve.tenants"):
        assert keyed.app.state.reload_keys() is False
    assert f"{reloadable}:15: tenant 'late': scope must be" in caplog.text
    assert complete(keyed, "web-key").status_code == 200
    assert_error(complete(keyed, "late-key"), 401, "invalid_api_key")


def test_fcfs_ignores_tenant_default_priorities_with_one_warning(keys_path, caplog):
    for policy, warnings in (("fcfs", 1), ("priority", 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pagedserve.entrypoints.openai.api_server"):
            tenant_store(ServerConfig(["m"], api_keys_file=str(keys_path), scheduling_policy=policy))
        assert len([r for r in caplog.records if "ignores the default priority of tenant(s) web" in r.message]) \
            == warnings


def wait_for_log_lines(caplog, text: str, count: int, timeout: float = 5.0) -> list[str]:
    """The messages that contain `text`, once there are `count` of them (a request's access-log line is
    written just after its response has gone out, so it may trail the client's read by a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [rec.getMessage() for rec in caplog.records if text in rec.getMessage()]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.01)
