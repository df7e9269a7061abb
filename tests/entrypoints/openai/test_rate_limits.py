"""Per-tenant rate limits through the live server, on a clock the tests move by hand: requests per minute, tokens
per minute (reserved, refused by count, refunded), concurrent requests; OpenAI's 429s and x-ratelimit headers;
refused requests never reach the engine."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from live_server import scrape, start_server, value
from pagedserve.tenants.rate_limiter import RateLimiter
from pagedserve.tenants.tenant import hash_key

TENANTS = {  # name: (limit field, value)
    "rpm": ("requests_per_minute", 5),
    "tokens": ("tokens_per_minute", 100),
    "refunds": ("tokens_per_minute", 1000),
    "conc": ("max_concurrent_requests", 4),
    "streams": ("max_concurrent_requests", 2),
}
PROMPT_10 = list(range(30, 40))  # 10 prompt tokens


class Clock:
    """Frozen unless a test moves it: no bucket refills behind a test's back."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def clock():
    return Clock()


@pytest.fixture(scope="module")
def limited(tiny_llama_dir, tmp_path_factory, clock):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text("".join(f'[tenants.{name}]\nkey_sha256 = "{hash_key(name + "-key")}"\n{field} = {limit}\n\n'
                            for name, (field, limit) in TENANTS.items()))
    live = start_server(tiny_llama_dir, "--api-keys-file", str(path), rate_limiter=RateLimiter(clock))
    yield live
    live.stop()


@pytest.fixture
def engine_calls(limited, monkeypatch):
    """Every AsyncLLM.generate call, and the most that were running at once."""
    calls = {"count": 0, "running": 0, "max_running": 0}
    original = limited.async_llm.generate

    async def counting(*args, **kwargs):
        calls["count"] += 1
        calls["running"] += 1
        calls["max_running"] = max(calls["max_running"], calls["running"])
        try:
            async for out in original(*args, **kwargs):
                yield out
        finally:
            calls["running"] -= 1

    monkeypatch.setattr(limited.async_llm, "generate", counting)
    return calls


def auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer {tenant}-key"}


def complete(server, tenant: str, prompt=PROMPT_10, max_tokens: int = 1, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, headers=auth(tenant), timeout=60)


def remaining_tokens(server, tenant: str) -> int:
    """The tokens left, from the headers of a route that costs nothing."""
    r = httpx.get(server.url + "/v1/models", headers=auth(tenant))
    assert r.status_code == 200
    return int(r.headers["x-ratelimit-remaining-tokens"])


def assert_rate_limited(r: httpx.Response, error_type: str) -> dict:
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "rate_limit_exceeded" and error["type"] == error_type
    return error


def test_the_sixth_request_in_a_minute_gets_429_with_retry_after_and_ratelimit_headers(limited, engine_calls,
                                                                                       clock):
    before = scrape(limited, auth("conc"))
    for i in range(5):
        r = complete(limited, "rpm")
        assert r.status_code == 200
        assert r.headers["x-ratelimit-limit-requests"] == "5"
        assert r.headers["x-ratelimit-remaining-requests"] == str(4 - i)
        assert r.headers["x-ratelimit-reset-requests"] == ["12s", "24s", "36s", "48s", "1m0s"][i]
        assert "x-ratelimit-limit-tokens" not in r.headers  # the tenant has no token limit
    sixth = complete(limited, "rpm")
    error = assert_rate_limited(sixth, "requests")
    assert sixth.headers["retry-after"] == "12" and "try again in 12s" in error["message"]
    assert sixth.headers["x-ratelimit-remaining-requests"] == "0"
    assert engine_calls["count"] == 5
    clock.now += 12  # one request's worth refills
    assert complete(limited, "rpm").status_code == 200
    assert complete(limited, "rpm").status_code == 429
    after = scrape(limited, auth("conc"))
    labels = {"model_name": "tiny", "tenant": "rpm"}
    assert value(after, "pagedserve:rate_limited_requests_total", limit="requests", **labels) - \
        value(before, "pagedserve:rate_limited_requests_total", limit="requests", **labels) == 2
    assert value(after, "pagedserve:tenant_requests_total", status="200", **labels) - \
        value(before, "pagedserve:tenant_requests_total", status="200", **labels) == 6


def test_token_limit_refusals_follow_token_counts(limited, engine_calls):
    for left in (70, 40, 10):  # each costs 10 prompt + 20 generated tokens, all of them used
        r = complete(limited, "tokens", max_tokens=20, ignore_eos=True)
        assert r.status_code == 200 and r.headers["x-ratelimit-remaining-tokens"] == str(left)
        assert r.headers["x-ratelimit-limit-tokens"] == "100"
    refused = complete(limited, "tokens", max_tokens=20, ignore_eos=True)  # 30 > 10 left
    assert_rate_limited(refused, "tokens")
    assert refused.headers["retry-after"] == "12"  # 20 tokens at 100 per minute
    assert complete(limited, "tokens", prompt=PROMPT_10[:5], max_tokens=5, ignore_eos=True).status_code == 200
    assert remaining_tokens(limited, "tokens") == 0
    assert engine_calls["count"] == 4


def test_a_request_over_the_whole_token_limit_is_told_it_can_never_pass(limited, engine_calls):
    for extra in ({"max_tokens": 200}, {"max_tokens": 50, "n": 2}, {}):  # {}: max_tokens fills the context
        r = httpx.post(limited.url + "/v1/completions", headers=auth("tokens"), timeout=60,
                       json={"prompt": PROMPT_10, **extra})
        error = assert_rate_limited(r, "tokens")
        assert "can never pass" in error["message"] and "Limit 100" in error["message"]
        assert r.headers["x-should-retry"] == "false" and "retry-after" not in r.headers
    assert engine_calls["count"] == 0


def generated_tokens(server, tenant: str) -> float:
    return value(scrape(server, auth("conc")), "pagedserve:tenant_generation_tokens_total", model_name="tiny",
                 tenant=tenant)


def test_short_completions_and_disconnects_give_back_what_they_did_not_generate(limited):
    every_token = list(range(limited.async_llm.vocab_size))  # whatever comes first ends the completion
    r = complete(limited, "refunds", max_tokens=50, stop_token_ids=every_token)
    assert r.json()["usage"]["completion_tokens"] == 1 and r.json()["choices"][0]["finish_reason"] == "stop"
    assert remaining_tokens(limited, "refunds") == 1000 - 11  # 60 reserved, 49 refunded
    with httpx.stream("POST", limited.url + "/v1/chat/completions", headers=auth("refunds"), timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50, "stream": True,
                            "stop_token_ids": every_token}) as r:
        assert r.status_code == 200
        assert [line for line in r.iter_lines() if line.startswith("data:")][-1] == "data: [DONE]"
    chat_prompt = httpx.post(limited.url + "/tokenize", headers=auth("refunds"),
                             json={"messages": [{"role": "user", "content": "Hi"}]}).json()["count"]
    assert remaining_tokens(limited, "refunds") == 1000 - 11 - (chat_prompt + 1)
    left, generated = remaining_tokens(limited, "refunds"), generated_tokens(limited, "refunds")
    with httpx.stream("POST", limited.url + "/v1/completions", headers=auth("refunds"), timeout=60,
                      json={"prompt": PROMPT_10, "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data:"))  # then the client goes away
    limited.wait_idle()
    used = 10 + generated_tokens(limited, "refunds") - generated
    assert used < 10 + 200 and remaining_tokens(limited, "refunds") == left - used


def test_the_concurrency_limit_holds_under_50_parallel_clients(limited, engine_calls):
    async def one(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post("/v1/completions", json={"prompt": PROMPT_10, "max_tokens": 100, "temperature": 0,
                                                        "ignore_eos": True})

    async def fifty() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=limited.url, headers=auth("conc"), timeout=120,
                                     limits=httpx.Limits(max_connections=50)) as http:
            return await asyncio.gather(*(one(http) for _ in range(50)))

    before = scrape(limited, auth("rpm"))
    responses = asyncio.run(fifty())
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert engine_calls["max_running"] <= 4 and engine_calls["count"] == len(ok) >= 4
    assert refused
    for r in refused:
        assert_rate_limited(r, "requests")
    assert all(r.json()["usage"]["completion_tokens"] == 100 for r in ok)
    assert all("x-ratelimit-limit-requests" not in r.headers for r in responses)  # no per-minute limits here
    labels = {"model_name": "tiny", "tenant": "conc", "limit": "concurrency"}
    assert value(scrape(limited, auth("rpm")), "pagedserve:rate_limited_requests_total", **labels) - \
        value(before, "pagedserve:rate_limited_requests_total", **labels) == len(refused)
    assert in_flight(limited, "conc") == 0


def in_flight(server, tenant: str) -> int:
    """The tenant's requests holding a concurrency slot, as the server's rate limiter counts them."""
    [limits] = [t.limits for t in server.app.state.tenants.registry.tenants if t.name == tenant]
    return server.app.state.rate_limiter.for_tenant(tenant, limits).in_flight


def test_a_stream_holds_its_slot_until_its_body_is_sent(limited, engine_calls):
    body = {"prompt": PROMPT_10, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=limited.url, headers=auth("streams"), timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as first, \
                http.stream("POST", "/v1/completions", json=body) as second:
            lines = [r.iter_lines() for r in (first, second)]
            for it in lines:
                next(line for line in it if line.startswith("data:"))
            assert_rate_limited(http.post("/v1/completions", json=body), "requests")
            assert in_flight(limited, "streams") == 2
            assert [line for line in lines[0] if line.startswith("data:")][-1] == "data: [DONE]"
            # The first's slot comes back once its whole body is sent (the second may have finished too).
            deadline = time.monotonic() + 5
            while in_flight(limited, "streams") > 1:
                assert time.monotonic() < deadline, "the finished stream still holds its slot"
                time.sleep(0.005)
            third = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert third.status_code == 200
    assert engine_calls["count"] == 3
