"""PAGEDSERVE_STEP_LOG: one line per engine step, its tokens adding up to what the requests computed."""

import glob

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.step_log import HEADER, STEP_LOG_ENV


def test_every_step_is_logged_with_its_tokens_requests_and_prefill_tokens(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path / "steps"))
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, max_num_batched_tokens=32)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40)]  # 40: chunked over two steps
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    (path,) = glob.glob(str(tmp_path / "steps-*.tsv"))
    with open(path) as f:
        assert f.readline() == HEADER
        rows = [line.split("\t") for line in f.read().splitlines()]
    starts, ends = [float(r[0]) for r in rows], [float(r[1]) for r in rows]
    tokens, requests, prefill = ([int(r[i]) for r in rows] for i in (2, 3, 4))
    assert all(s <= e for s, e in zip(starts, ends)) and all(e <= s for e, s in zip(ends, starts[1:]))
    assert sum(tokens) == 5 + 40 + 2 * 5  # prompts, then every generated token but the last of each
    assert sum(prefill) == 45 and max(tokens) <= 32
    assert prefill[:2] == [32, 13]  # the short prompt and 27 of the long one; then its last 13
    assert requests[:2] == [2, 2] and all(r <= 2 for r in requests)


def test_no_log_without_the_variable(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(STEP_LOG_ENV, raising=False)
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22)
    llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.core._step_log is None and not list(tmp_path.iterdir())


def test_a_log_path_that_cannot_be_written_is_an_error_naming_the_variable(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path / "no such dir" / "steps"))
    with pytest.raises(ValueError, match="PAGEDSERVE_STEP_LOG: cannot write the step log .*no such dir"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22)
