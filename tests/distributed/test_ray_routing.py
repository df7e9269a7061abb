"""The Ray app with two engine replicas and prefix routing: a shared prefix stays on the replica that cached it
(under its own tenant only), unrelated prefixes spread, a flood spills over, limits answer as on one server, and
a replica killed mid-run costs only the streams it had started."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints", "openai"))

from ray_cluster import MODEL_NAME, deploy, ray, ray_port  # noqa: E402,F401 - fixture
from test_api_keys import tenant_toml  # noqa: E402

BLOCK = 16
PREFIX = list(range(30, 30 + 4 * BLOCK))  # 4 full blocks
THRESHOLD = 8


KEYS = (tenant_toml("a", "key-a") + tenant_toml("b", "key-b") + tenant_toml("ops", "key-ops", scope="admin")
        + tenant_toml("limited", "key-limited", requests_per_minute=2))


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def app(ray_port, tiny_llama_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    app = deploy(ray_port, tiny_llama_dir, num_replicas=2, api_keys_file=str(keys), max_num_seqs=4,
                 max_model_len=1024, router_imbalance_threshold=THRESHOLD)
    app.admin_headers = auth("key-ops")
    app.wait_replicas(2)
    return app


def complete(app, prompt: list[int], key: str = "key-a", max_tokens: int = 2, **extra) -> httpx.Response:
    return httpx.post(app.url + "/v1/completions", headers=auth(key), timeout=120,
                      json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            **extra})


async def complete_all(app, prompts: list[list[int]], key: str = "key-a", max_tokens: int = 2) -> list:
    async with httpx.AsyncClient(base_url=app.url, headers=auth(key), timeout=120) as http:
        return await asyncio.gather(*[
            http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": p, "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": True}) for p in prompts])


def replica_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.headers["x-pagedserve-replica"]


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_requests_sharing_a_prefix_land_on_the_replica_that_cached_it(app):
    warm = complete(app, PREFIX + [7])
    home = replica_of(warm)
    rs = asyncio.run(complete_all(app, [PREFIX + [200 + i, 201 + i] for i in range(8)]))
    assert {replica_of(r) for r in rs} == {home}
    assert all(cached(r) >= 4 * BLOCK for r in rs), [cached(r) for r in rs]


def test_the_request_id_header_comes_back_once_as_the_client_gave_it(app):
    r = httpx.post(app.url + "/v1/completions", timeout=60, headers={**auth("key-a"), "X-Request-Id": "mine-1"},
                   json={"model": MODEL_NAME, "prompt": [5, 6], "max_tokens": 1})
    assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["mine-1"]
    assert r.json()["id"].endswith("mine-1")


def test_the_same_prompt_under_another_key_shares_nothing(app):
    complete(app, PREFIX + [9])
    other = complete(app, PREFIX + [9], key="key-b")
    assert cached(other) == 0
    again = complete(app, PREFIX + [9], key="key-b")
    assert cached(again) >= 4 * BLOCK and replica_of(again) == replica_of(other)


def test_unrelated_prefixes_spread_over_both_replicas(app):
    prompts = [[300 + 7 * g + i for i in range(3 * BLOCK)] for g in range(8)]
    rs = asyncio.run(complete_all(app, [[t % 350 + 3 for t in p] for p in prompts], max_tokens=16))
    replicas = [replica_of(r) for r in rs]
    assert len(set(replicas)) == 2 and min(replicas.count(r) for r in set(replicas)) >= 2, replicas


def test_a_flood_on_one_prefix_spills_over_past_the_threshold(app):
    prompt = list(range(100, 100 + 4 * BLOCK))
    home = replica_of(complete(app, prompt + [1]))
    # Long answers (200 tokens) keep the first requests in flight while the last ones are still being sent. Ray
    # may rank all 24 before it sends any: the router counts each as load from the moment it ranks it.
    rs = asyncio.run(complete_all(app, [prompt + [2 + i] for i in range(3 * THRESHOLD)], max_tokens=200))
    replicas = [replica_of(r) for r in rs]
    assert replicas.count(home) > THRESHOLD, replicas  # the prefix's replica takes its share first ...
    assert len(set(replicas)) == 2, replicas            # ... and the rest spills to the other one


def test_rate_limits_answer_429_as_on_one_server(app):
    for _ in range(2):
        assert complete(app, [5, 6, 7], key="key-limited", max_tokens=1).status_code == 200
    r = complete(app, [5, 6, 7], key="key-limited", max_tokens=1)
    error = r.json()["error"]
    assert r.status_code == 429 and (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-remaining-requests"] == "0"


def test_a_user_key_may_not_reset_the_prefix_caches_and_an_admin_key_resets_all(app):
    assert httpx.post(app.url + "/reset_prefix_cache", headers=auth("key-a"), timeout=30).status_code == 403
    assert httpx.post(app.url + "/reset_prefix_cache", headers=auth("key-ops"), timeout=30).status_code == 200
    assert cached(complete(app, PREFIX + [7])) == 0


def test_the_ingress_metrics_label_each_replica_and_count_its_own_once(app):
    text = httpx.get(app.url + "/metrics", headers=auth("key-ops"), timeout=30).text
    got = {(s.name, frozenset(s.labels.items())): s.value
           for family in text_string_to_metric_families(text) for s in family.samples}
    assert len(app.reporting_replicas()) == 2
    tenant_a = [labels for name, labels in got if name == "pagedserve:tenant_requests_total"
                and dict(labels).get("tenant") == "a"]
    assert tenant_a and all("replica" not in dict(labels) for labels in tenant_a)  # counted at the ingress
    engine = [dict(labels) for name, labels in got if name == "pagedserve:prompt_tokens_total"]
    assert {labels["replica"] for labels in engine} == app.reporting_replicas()
    assert sum(v for (name, _), v in got.items() if name == "pagedserve:prompt_tokens_total") > 0


def engine_cores(replica_id: str) -> list:
    """The engine-core process of one replica: the spawned child of the Ray worker whose Serve log is that
    replica's."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        if "EngineReplica" not in " ".join(proc.info["cmdline"] or []):
            continue
        try:
            if any(f.path.endswith(f"EngineReplica_{replica_id}.log") for f in proc.open_files()):
                return [c for c in proc.children() if "spawn_main" in " ".join(c.cmdline())]
        except psutil.Error:
            continue
    return []


def test_a_replica_whose_engine_died_is_avoided_and_then_replaced(app):
    prompt = list(range(150, 150 + 2 * BLOCK))
    victim = replica_of(complete(app, prompt + [1]))
    cores = engine_cores(victim)
    assert len(cores) == 1
    cores[0].kill()
    cores[0].wait(10)
    time.sleep(0.5)  # the replica's reader thread sees its pipe close
    r = complete(app, prompt + [2])  # the prefix says `victim`; its engine is gone: sent to the other replica
    assert replica_of(r) != victim and r.json()["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 120
    while victim in app.reporting_replicas():  # Ray's health check fails it and starts another
        assert time.monotonic() < deadline
        time.sleep(0.5)
    app.wait_replicas(2)


def stream_events(app, prompt: list[int], seen_first: threading.Event, out: list) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 700, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events = []
    try:
        with httpx.stream("POST", app.url + "/v1/completions", json=body, headers=auth("key-a"),
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    seen_first.set()
        out.append((r.status_code, r.headers.get("x-pagedserve-replica"), events))
    except Exception as e:  # noqa: BLE001 - recorded, the test looks at it
        out.append((None, None, [repr(e)]))


def test_killing_a_replica_fails_only_the_streams_it_had_started(app):
    prompt = list(range(200, 200 + 2 * BLOCK))
    victim = replica_of(complete(app, prompt + [1]))
    results: list = []
    first = threading.Event()
    threads = [threading.Thread(target=stream_events, args=(app, prompt + [5 + i], first, results))
               for i in range(8)]  # 4 run (max_num_seqs=4), 4 wait on the same replica
    for t in threads:
        t.start()
    assert first.wait(60)
    time.sleep(0.5)
    ray.kill(app.replica_actor(victim), no_restart=True)
    for t in threads:
        t.join(120)
    assert len(results) == 8
    failed = [ev for status, _, ev in results if any('"error"' in e for e in ev)]
    done = [ev for status, replica, ev in results if status == 200 and ev and ev[-1] == "[DONE]"
            and not any('"error"' in e for e in ev)]
    assert len(failed) + len(done) == 8, results
    assert 1 <= len(failed) <= 4  # the started ones: each ends with an error event, then [DONE]
    assert all(ev[-1] == "[DONE]" and json.loads(ev[-2])["error"]["code"] == "engine_dead"
               and "replica serving this request died" in ev[-2] for ev in failed)
    assert len(done) >= 4  # every request that had not started ran again elsewhere, to the end
    assert all(json.loads(ev[-2])["choices"][0]["finish_reason"] == "length" for ev in done)
    app.wait_replicas(2)  # Ray replaces the dead replica
    assert complete(app, [5, 6, 7]).status_code == 200
