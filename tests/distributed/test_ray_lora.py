"""LoRA adapters on the Ray app: every replica loads the --lora-modules at start, and the single server's LoRA
tests (each adapter's text equals the offline engine's, /v1/models, 404s) pass through it unchanged."""

from __future__ import annotations

import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints", "openai"))

from ray_cluster import deploy, ray_port  # noqa: E402,F401 - fixture
from pagedserve import LoRARequest  # noqa: E402
from test_lora_server import (  # noqa: E402,F401 - fixtures and the tests that run here again
    adapters, complete, offline, offline_text, test_model_selects_the_adapter_and_each_equals_the_offline_engine,
    test_models_lists_each_adapter_with_its_parent_and_path, test_unknown_model_is_404_listing_the_adapters)


@pytest.fixture(scope="module")
def server(ray_port, tiny_llama_dir, adapters):  # noqa: F811 - the Ray app under the single server's name
    app = deploy(ray_port, tiny_llama_dir, num_replicas=2, enable_lora=True, max_loras=2, max_lora_rank=16,
                 lora_modules=[f"a={adapters['a']}", f"b={adapters['b']}"])
    app.wait_replicas(2)
    return app


def test_every_replica_serves_every_adapter(server, offline, adapters):  # noqa: F811
    want = offline_text(offline, LoRARequest("b", 2, adapters["b"]))
    seen = set()
    for i in range(16):  # no full block to follow: each goes to the lighter of two idle replicas, at random
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "b", "prompt": [5 + i] * 3, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-pagedserve-replica"])
        assert complete(server.url, "b") == want
    assert len(seen) == 2
