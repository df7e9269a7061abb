"""`pagedserve bench soak` for 60 s against `pagedserve serve` on the tiny model (the CI soak): every request
gets one sound outcome, the server drains, leaks nothing and exits 0 on SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys

SERVE = ("--dtype float32 --max-model-len 256 --max-num-seqs 8 --max-num-queued-requests 16 "
         "--kv-cache-memory-bytes 4194304 --disable-log-requests --api-key soak-key")


def test_a_60_second_soak_of_the_tiny_model_finds_no_violation(tiny_llama_dir, tmp_path):
    result = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "soak",
                           "--serve-args", f"--model {tiny_llama_dir} {SERVE}", "--api-key", "soak-key",
                           "--duration", "60", "--warmup", "10", "--result-file", str(result)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(result.read_text())
    outcomes = summary["outcomes"]
    assert summary["violations"] == 0 and summary["server_errors_5xx"] == 0 and summary["server_exit_code"] == 0
    # the load really was past capacity, with every kind of request in it
    assert all(outcomes.get(kind, 0) > 0 for kind in ("complete", "rejected", "throttled", "disconnected"))
    assert summary["greedy_checked"] > 50 and summary["drain_seconds"] <= 1.0
    resources = summary["resources"]
    assert resources["after_load"]["processes"] >= 2  # the engine core's process was watched too
    assert "PASS" in proc.stdout
