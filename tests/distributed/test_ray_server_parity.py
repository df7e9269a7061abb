"""The single server's own tests, run against the Ray app (ingress + one engine replica): every response,
stream, error and small route is the same through Ray Serve, and greedy text equals the offline LLM's."""

from __future__ import annotations

import os
import sys

import openai
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints", "openai"))

from ray_cluster import deploy, ray_port  # noqa: E402,F401 - fixture
from test_errors import (test_limits_on_n_logprobs_stop_are_400, test_malformed_json_and_schema_violations_are_400,  # noqa: E402,F401,E501
                         test_sampling_params_errors_name_the_parameter, test_too_long_is_400_with_both_numbers,
                         test_unknown_model_is_404, test_unknown_route_and_wrong_method)
from test_serving import (offline, test_chat_content_parts_equal_the_string, test_chat_logprobs_n_and_seed,  # noqa: E402,F401,E501
                          test_chat_non_streaming_and_streaming, test_completion_logprobs,
                          test_completion_matches_offline_and_reports_usage,
                          test_concurrent_streams_each_get_the_offline_greedy_text, test_echo_prepends_the_prompt,
                          test_model_may_be_omitted_or_any_served_name, test_models_health_version,
                          test_n_and_seed_reproducibility, test_prompt_forms_lists_and_token_ids,
                          test_stop_string_ends_the_text, test_streamed_completion_equals_non_streamed,
                          test_tokenize_and_detokenize)


@pytest.fixture(scope="module")
def server(ray_port, tiny_llama_dir):
    app = deploy(ray_port, tiny_llama_dir, num_replicas=1)
    app.wait_replicas(1)
    return app


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
