"""Prefix caching seen from the server: cached tokens in usage, metrics, and no sharing between API keys."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import MODEL_NAME, server, start_server  # noqa: F401 - fixtures

PROMPT = list(range(30, 80))  # 50 tokens: 3 full blocks of 16 can come from the cache (never the last token)


def complete(url, prompt, key=None, stream=False, **extra):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "temperature": 0, **extra}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        import json

        return json.loads(chunks[-1])["usage"]
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def prefix_metrics(url, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(url + "/metrics", headers=headers).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name.startswith("pagedserve:prefix_cache")}
    return values["pagedserve:prefix_cache_queries_total"], values["pagedserve:prefix_cache_hits_total"]


def test_usage_reports_cached_prompt_tokens_and_metrics_count_them(server):
    queries0, hits0 = prefix_metrics(server.url)
    first = complete(server.url, PROMPT)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = complete(server.url, PROMPT, stream=True)
    assert second["prompt_tokens"] == 50 and second["prompt_tokens_details"] == {"cached_tokens": 48}
    server.wait_idle()
    queries, hits = prefix_metrics(server.url)
    assert queries - queries0 == 100 and hits - hits0 == 48


@pytest.fixture(scope="module")
def keyed(tiny_llama_dir):
    live = start_server(tiny_llama_dir, "--api-key", "key-1", "--api-key", "key-2")
    yield live
    live.stop()


def test_two_api_keys_never_share_cached_blocks(keyed):
    url = keyed.url
    assert complete(url, PROMPT, key="key-1")["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(url, PROMPT, key="key-1")["prompt_tokens_details"]["cached_tokens"] == 48
    # Same prompt, other key: nothing from key-1's cache, even when it asks for key-1's salt by name.
    assert complete(url, PROMPT, key="key-2")["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(url, PROMPT, key="key-2", cache_salt="key-1")["prompt_tokens_details"]["cached_tokens"] == 0
    # A client salt is added on top of the key's: key-1 with its own salt starts a separate cache.
    assert complete(url, PROMPT, key="key-1", cache_salt="mine")["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(url, PROMPT, key="key-1", cache_salt="mine")["prompt_tokens_details"]["cached_tokens"] == 48
