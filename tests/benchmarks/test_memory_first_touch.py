"""benchmarks/memory_first_touch.py: each way of taking memory gives a commit rate."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "memory_first_touch.py")
spec = importlib.util.spec_from_file_location("memory_first_touch", SCRIPT)
memory_first_touch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory_first_touch)


def _needs_populate_write() -> None:
    release = tuple(int(part) for part in os.uname().release.split("-")[0].split(".")[:2])
    if release < (5, 14):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14): nothing to time")


def test_fresh_again_and_new_process_rates_are_reported_per_delay():
    _needs_populate_write()
    out = subprocess.run([sys.executable, SCRIPT, "--mib", "8", "--delays", "0,0.1"], capture_output=True, text=True,
                         check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["mib"] == 8
    assert list(result["seconds_per_gib"]) == ["fresh", "again", "new process 0 s later", "new process 0.1 s later"]
    assert all(seconds > 0 for seconds in result["seconds_per_gib"].values())


def test_a_size_below_one_mib_is_refused():
    result = subprocess.run([sys.executable, SCRIPT, "--mib", "0"], capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "--mib must be at least 1" in result.stderr
