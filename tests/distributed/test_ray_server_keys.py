"""The single server's API-key, body-limit and queue-limit tests, run against the Ray app: 401 on every route
without a valid key, /health open, 413 over the body limit, 429 when the engine's queue is full."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints", "openai"))

from ray_cluster import deploy, ray_port  # noqa: E402,F401 - fixture
from test_errors import (test_body_over_the_limit_is_413, test_every_route_needs_the_key,  # noqa: E402,F401
                         test_health_needs_no_key, test_queue_full_is_429_and_admitted_requests_finish)


@pytest.fixture(scope="module")
def guarded(ray_port, tiny_llama_dir):
    """The flags of test_errors.py's `guarded` server."""
    app = deploy(ray_port, tiny_llama_dir, num_replicas=1, api_key=["key-1", "key-2"], max_num_seqs=1,
                 max_num_queued_requests=1, max_request_body_bytes=4096, max_model_len=1024)
    app.admin_headers = {"Authorization": "Bearer key-1"}
    # The queue-full test's first request must outlast a trip through Ray's proxy, router and metrics for the
    # second and third (200 tokens were done first on a fast CPU now and then): 1000 tokens, a longer context.
    app.long_max_tokens = 1000
    app.wait_replicas(1)
    return app
