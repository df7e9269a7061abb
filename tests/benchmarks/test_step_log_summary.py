"""benchmarks/step_log.py: a log's run starts at its first large prefill; decode steps are timed apart."""
import importlib.util
import os
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "step_log.py")
spec = importlib.util.spec_from_file_location("step_log_summary", SCRIPT)
step_log = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = step_log  # its dataclass looks its module up
spec.loader.exec_module(step_log)

HEADER = "start\tend\ttokens\trequests\tprefill_tokens\n"


def write(path, steps):
    path.write_text(HEADER + "".join("\t".join(str(v) for v in step) + "\n" for step in steps))
    return str(path)


def test_warm_ups_are_skipped_and_full_decode_steps_timed_apart(tmp_path):
    steps = [(0.0, 0.1, 8, 2, 8), (0.1, 0.2, 2, 2, 0),  # a warm-up: no prefill of 1024 tokens
             (1.0, 2.0, 2048, 16, 2048), (2.0, 2.5, 2048, 32, 2032), (2.6, 2.8, 32, 32, 0), (2.8, 3.1, 32, 32, 0),
             (3.1, 3.2, 16, 16, 0)]
    r = step_log.summarize(step_log.read_steps(write(tmp_path / "a.tsv", steps)))
    assert r["steps"] == 5 and r["span_s"] == pytest.approx(2.2)
    assert r["between_steps_s"] == pytest.approx(0.1)
    assert r["prefill_steps"] == 2 and r["prefill_s"] == pytest.approx(1.5)
    assert r["decode_steps"] == 3 and r["decode_rows"] == 32 and r["full_decode_steps"] == 2
    assert r["full_decode_median_ms"] == pytest.approx(250.0)


def test_a_log_without_a_large_prefill_is_an_error_that_says_so(tmp_path):
    path = write(tmp_path / "b.tsv", [(0.0, 0.1, 8, 2, 8)])
    with pytest.raises(ValueError, match="no step with at least 1024 prefill tokens"):
        step_log.summarize(step_log.read_steps(path))
