"""On one workload of groups sharing prefixes, prefix routing serves more prompt tokens from cache than
round-robin (each policy on a fresh pair of replicas)."""

from __future__ import annotations

import httpx

from ray_cluster import MODEL_NAME, deploy, ray_port  # noqa: F401 - fixture

BLOCK = 16


def workload() -> list[list[int]]:
    """3 groups x 4 requests, each a 4-block group prefix and a question of its own, the groups interleaved."""
    prefixes = [[(40 + 11 * g + i) % 380 + 3 for i in range(4 * BLOCK)] for g in range(3)]
    return [prefixes[i % 3] + [5 + i, 6 + i] for i in range(12)]


def cached_tokens(app) -> tuple[int, set[str]]:
    total, replicas = 0, set()
    for prompt in workload():
        r = httpx.post(app.url + "/v1/completions", timeout=120,
                       json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        total += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        replicas.add(r.headers["x-pagedserve-replica"])
    return total, replicas


def test_prefix_routing_caches_more_than_round_robin(ray_port, tiny_llama_dir):
    totals = {}
    for policy in ("round-robin", "prefix"):
        app = deploy(ray_port, tiny_llama_dir, num_replicas=2, router=policy)
        app.wait_replicas(2)
        totals[policy], used = cached_tokens(app)
        if policy == "round-robin":
            assert len(used) == 2
    # Round-robin: each group's 4 requests alternate over both replicas (2 hits per group); prefix: 3 per group.
    assert totals["prefix"] == 3 * 3 * 4 * BLOCK
    assert totals["round-robin"] < totals["prefix"]  # 3 * 2 * 4 * BLOCK when each request takes one turn
