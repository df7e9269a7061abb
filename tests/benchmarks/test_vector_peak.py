"""benchmarks/vector_peak.py: the register-only peak loops build and report one rate per thread."""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "vector_peak.py")
spec = importlib.util.spec_from_file_location("vector_peak", SCRIPT)
vector_peak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vector_peak)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the loops")


@pytest.mark.parametrize("name", list(vector_peak._KINDS))
def test_each_kind_the_cpu_has_gives_a_positive_rate_per_thread(name, tmp_path):
    kind = vector_peak._KINDS[name]
    if kind[0] not in vector_peak.cpu_flags():
        pytest.skip(f"this CPU has no {kind[0]}: {name} is not measured here")
    rates = vector_peak.measure(kind, 2, str(tmp_path), iterations=100_000)
    assert len(rates) == 2 and all(rate > 0 for rate in rates)


def test_a_thread_count_below_one_is_refused():
    result = subprocess.run([sys.executable, SCRIPT, "--threads", "0"], capture_output=True, text=True)
    assert result.returncode == 2 and "--threads and --iterations must be at least 1" in result.stderr
