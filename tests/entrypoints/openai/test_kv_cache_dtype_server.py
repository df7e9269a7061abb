"""--kv-cache-dtype through the server: every KV dtype serves completions and streamed chat, /metrics names
it in cache_config_info (with the block count it bought), every block is freed, and a bad value is a CLI
error before anything loads."""

from __future__ import annotations

import openai
import pytest

from conftest import assert_no_leaked_blocks
from live_server import MODEL_NAME, scrape, start_server
from pagedserve.entrypoints.cli import build_parser


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_every_kv_cache_dtype_serves_and_reports_itself(tiny_llama_dir, kv_cache_dtype):
    live = start_server(tiny_llama_dir, "--kv-cache-dtype", kv_cache_dtype)
    try:
        with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            done = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=8,
                                             temperature=0, logprobs=2)
            assert done.usage.completion_tokens == len(done.choices[0].logprobs.tokens) > 0
            stream = client.chat.completions.create(model=MODEL_NAME, stream=True, max_tokens=8, n=2,
                                                    messages=[{"role": "user", "content": "Hello"}])
            finished = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
            assert len(finished) == 2
        live.wait_idle()
        samples = scrape(live)
        info = [dict(labels) for (name, labels), v in samples.items() if name == "pagedserve:cache_config_info"]
        assert len(info) == 1 and info[0]["cache_dtype"] == kv_cache_dtype
        assert int(info[0]["num_gpu_blocks"]) == live.async_llm.info.num_blocks
        assert_no_leaked_blocks(live.async_llm)
    finally:
        live.stop()


def test_an_unknown_kv_cache_dtype_is_a_cli_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp4"])
    assert "invalid choice: 'fp4'" in capsys.readouterr().err
