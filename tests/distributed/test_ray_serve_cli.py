"""`pagedserve serve --ray` as a user runs it: it starts a local Ray cluster, serves on --port, and on SIGTERM
lets the streams in flight finish (every replica drains) before it exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray", reason="the Ray tests need ray[serve] (pip install 'pagedserve[ray]')")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints", "openai"))

from live_server import stream_across_signal  # noqa: E402
from test_api_keys import tenant_toml  # noqa: E402
from ray_cluster import free_port  # noqa: E402

FLAGS = ["--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 23), "--max-model-len", "256",
         "--served-model-name", "tiny"]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the Ray app did not start"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def start(model_dir: str, port: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--ray", "--model",
                             model_dir, "--port", str(port), *FLAGS, *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_sigterm_drains_the_streams_in_flight_and_exits_0(tiny_llama_dir):
    port = free_port()
    proc = start(tiny_llama_dir, port, "--num-replicas", "2", "--log-format", "json")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        lines = stream_across_signal(proc, url, signal.SIGTERM)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(90) == 0
        out = proc.stdout.read().decode()
        assert f"pagedserve is ready on Ray Serve: http://127.0.0.1:{port}/v1 (2 engine replica(s)" in out
        # the ingress's access log, as JSON, forwarded by Ray from its worker
        [access] = [line[line.index("{"):] for line in out.splitlines() if '"logger": "pagedserve.requests"' in line]
        assert json.loads(access)["completion_tokens"] == 200 and json.loads(access)["status"] == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sighup_re_reads_the_keys_file_in_the_ingress(tiny_llama_dir, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text(tenant_toml("a", "key-a"))
    port = free_port()
    proc = start(tiny_llama_dir, port, "--num-replicas", "1", "--api-keys-file", str(keys))
    url = f"http://127.0.0.1:{port}"

    def models(key: str) -> int:
        return httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code

    try:
        wait_healthy(proc, url)
        assert (models("key-a"), models("key-b")) == (200, 401)
        keys.write_text(tenant_toml("b", "key-b"))
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while models("key-b") != 200:
            assert time.monotonic() < deadline, "the keys file was not re-read"
            time.sleep(0.2)
        assert models("key-a") == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
