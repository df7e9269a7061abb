"""`pagedserve bench serve` against a live `pagedserve serve` (a subprocess) on the tiny random Llama."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from fake_openai_server import free_port
from pagedserve.benchmarks import serve

START_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def live_server(tiny_llama_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--model", tiny_llama_dir, "--port", str(port),
           "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
           "--kv-cache-memory-bytes", str(1 << 23), "--max-model-len", "256", "--disable-log-requests"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            assert proc.poll() is None, f"pagedserve serve exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"pagedserve serve did not start:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _args(*argv: str) -> argparse.Namespace:
    return serve.add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_token_id_prompts_all_succeed_with_exact_token_counts(live_server, tiny_llama_dir):
    result = serve.main(_args("--base-url", live_server, "--tokenizer", tiny_llama_dir, "--dataset-name", "random",
                              "--prompt-format", "token-ids", "--random-input-len", "16", "--random-output-len", "8",
                              "--num-prompts", "8", "--max-concurrency", "4", "--ignore-eos", "--num-warmups", "1",
                              "--disable-tqdm"))
    assert result["model_id"] == "tiny"
    assert (result["completed"], result["failed"]) == (8, 0), result["errors"]
    assert result["input_lens"] == [16] * 8 and result["output_lens"] == [8] * 8
    assert result["total_output_tokens"] == 64 and 1 <= result["max_concurrent_requests"] <= 4
    assert all(len(itl) >= 1 for itl in result["itls"]) and result["mean_tpot_ms"] > 0
    assert all(t > 0 for t in result["ttfts"])
    server = result["server_metrics"]  # pagedserve's own counters moved by exactly this run
    assert server["counters_delta"]["generation_tokens"] == 64
    assert server["counters_delta"]["prompt_tokens"] == 8 * 16
    assert server["num_preemptions"] == 0 and server["mean_queue_time_ms"] >= 0


def test_chat_text_prompts(live_server, tiny_llama_dir):
    result = serve.main(_args("--base-url", live_server, "--backend", "openai-chat", "--tokenizer", tiny_llama_dir,
                              "--dataset-name", "random", "--random-input-len", "12", "--random-output-len", "4",
                              "--num-prompts", "4", "--ignore-eos", "--request-rate", "50", "--disable-tqdm"))
    assert (result["completed"], result["failed"]) == (4, 0), result["errors"]
    assert result["output_lens"] == [4] * 4


def test_compare_serving_script_smoke(tiny_llama_dir, tmp_path):
    """benchmarks/compare_serving.py end to end on a tiny load (the real run is 256 x 128 -> 128)."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "compare_serving.py")
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, script, "--model", tiny_llama_dir, "--dtype", "float32",
                           "--num-prompts", "4", "--input-len", "8", "--output-len", "3", "--max-concurrency", "2",
                           "--num-warmups", "1", "--server-arg=--kv-cache-memory-bytes=8388608",
                           "--server-arg=--max-model-len=256", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = (out / "table.md").read_text()
    assert "| all 4 at once | 4 |" in table and "| max concurrency 2 | 4 |" in table
    for name in ("all_at_once.json", "concurrency2.json"):
        saved = json.loads((out / name).read_text())
        assert saved["completed"] == 4 and saved["output_lens"] == [3] * 4


def test_compare_prefix_caching_script_smoke(tiny_llama_dir, tmp_path):
    """benchmarks/compare_prefix_caching.py end to end on a tiny shared-prefix load: the cache really hits."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "compare_prefix_caching.py")
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, script, "--model", tiny_llama_dir, "--dtype", "float32",
                           "--num-prompts", "8", "--num-prefixes", "2", "--prefix-len", "48", "--suffix-len", "4",
                           "--output-len", "2", "--server-arg=--kv-cache-memory-bytes=8388608",
                           "--server-arg=--max-model-len=256", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = (out / "table.md").read_text()
    assert "| prefix caching on | 8 |" in table and "| prefix caching off | 8 |" in table
    assert "TTFT p50 off/on" in table
