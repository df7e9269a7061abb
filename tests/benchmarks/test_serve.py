"""`pagedserve bench serve` against a fake OpenAI server that streams with known delays.

The fake server (fake_openai_server.py) writes chunk i of every request at ttft + i * itl after it gets
the request; it records when it wrote each chunk. The client's measured TTFT, ITL, TPOT, E2E and
throughput are checked against the nominal delays (the server can only be late, by scheduling jitter: a
small upper tolerance) and the client's receive times against the server's write times (tight).
"""

from __future__ import annotations

import argparse
import json

import pytest

from fake_openai_server import FakeOpenAIServer, free_port
from pagedserve.benchmarks import serve, serve_metrics
from pagedserve.entrypoints.cli import main as cli

TTFT, ITL = 0.08, 0.02
LATE_MS = 25  # the fake server's sleeps may overshoot on a busy machine; never undershoot
DELIVERY_MS = 10  # receive time - the server's write time, per chunk


def _args(*argv: str) -> argparse.Namespace:
    return serve.add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))


def _jsonl(tmp_path, prompts: list[str], name: str = "prompts.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def _near(measured_ms: float, truth_ms: float, late_ms: float = LATE_MS) -> bool:
    return truth_ms - 1 <= measured_ms <= truth_ms + late_ms


def test_timings_match_the_known_delays(tmp_path, capsys):
    n_tok = 6
    prompts = [f"p{i}" for i in range(4)]
    with FakeOpenAIServer(ttft_s=TTFT, itl_s=ITL) as server:
        result = serve.main(_args("--base-url", server.url, "--dataset-name", "jsonl",
                                  "--dataset-path", _jsonl(tmp_path, prompts), "--num-prompts", "4",
                                  "--jsonl-output-len", str(n_tok), "--disable-tqdm"))
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["model_id"] == "fake-model"  # from /v1/models
    assert result["total_output_tokens"] == 4 * n_tok and result["output_lens"] == [n_tok] * 4  # usage
    assert result["total_input_tokens"] == 4 * 3  # no tokenizer: the server's usage.prompt_tokens
    e2e_ms = 1000 * (TTFT + (n_tok - 1) * ITL)
    for key, truth in (("ttft", 1000 * TTFT), ("tpot", 1000 * ITL), ("itl", 1000 * ITL), ("e2el", e2e_ms)):
        for stat in ("mean", "median", "p90", "p99"):
            assert _near(result[f"{stat}_{key}_ms"], truth), (key, stat, result[f"{stat}_{key}_ms"], truth)
    assert all(len(itl) == n_tok - 1 for itl in result["itls"])
    # all at once: the run lasts one request's E2E; the throughput figures are the counts over it
    assert _near(1000 * result["duration"], e2e_ms)
    assert result["request_throughput"] == pytest.approx(4 / result["duration"])
    assert result["output_throughput"] == pytest.approx(4 * n_tok / result["duration"])
    assert result["total_token_throughput"] == pytest.approx((4 * n_tok + 12) / result["duration"])
    assert result["max_concurrent_requests"] == 4
    # every request's TTFT and TPOT follow from its own timestamps
    for ttft, itl, e2e in zip(result["ttfts"], result["itls"], result["e2els"]):
        assert e2e >= ttft + sum(itl) - 1e-9
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Successful requests:" in printed
    assert "Mean TTFT (ms):" in printed and "P99 ITL (ms):" in printed


def test_client_receive_times_follow_the_server_write_times(tmp_path):
    prompts = [f"q{i}" for i in range(3)]
    with FakeOpenAIServer(ttft_s=0.03, itl_s=0.01) as server:
        args = _args("--base-url", server.url, "--dataset-name", "jsonl", "--dataset-path", _jsonl(tmp_path, prompts),
                     "--num-prompts", "3", "--jsonl-output-len", "8", "--disable-tqdm")
        import asyncio

        from pagedserve.benchmarks import serve_datasets

        requests = serve_datasets.build_requests(args, None)
        run = asyncio.run(serve.run_load(args, server.url, "/v1/completions", None, requests, None, progress=False))
    for req, r in zip(requests, run["results"]):
        written = server.sent[req.prompt]
        assert len(written) == len(r.chunk_times) == 8
        for w, got in zip(written, r.chunk_times):
            assert 0 <= (got - w) * 1000 <= DELIVERY_MS
        assert r.ttft == pytest.approx(r.chunk_times[0] - r.start_time)
        assert r.itl == pytest.approx([b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])])


def test_max_concurrency_waves_goodput_and_server_metrics(tmp_path, capsys):
    prompts = ["a0", "SLOW a1", "a2", "a3", "SLOW a4", "a5"]
    n_tok = 3
    with FakeOpenAIServer(ttft_s=0.03, itl_s=ITL, slow_extra_s=0.12) as server:
        result = serve.main(_args("--base-url", server.url, "--dataset-name", "jsonl",
                                  "--dataset-path", _jsonl(tmp_path, prompts), "--num-prompts", "6",
                                  "--jsonl-output-len", str(n_tok), "--max-concurrency", "2",
                                  "--goodput", "ttft:100", "--num-warmups", "2", "--disable-tqdm"))
        assert server.num_requests == 8  # 2 warm-ups + 6
    assert result["completed"] == 6 and result["max_concurrent_requests"] == 2
    fast, slow = 1000 * (0.03 + 2 * ITL), 1000 * (0.15 + 2 * ITL)
    e2els = [1000 * x for x in result["e2els"]]
    for prompt, e2e in zip(prompts, e2els):
        # the slow and fast ones differ by 120 ms; a loaded CI machine was seen 28 ms late on one request
        assert _near(e2e, slow if "SLOW" in prompt else fast, late_ms=50), (prompt, e2e)
    # two slots: 3 waves; the slow requests sit in different slots, so the run lasts slow + 2 fast at least
    assert 1000 * result["duration"] >= slow + 2 * fast - 1
    assert result["request_goodput"] == pytest.approx(4 / result["duration"])  # the 2 slow miss ttft:100
    # the server's counters moved by what the 6 timed requests did (warm-ups come before the first read)
    view = result["server_metrics"]
    assert view["num_preemptions"] == 12 and view["mean_queue_time_ms"] == pytest.approx(4.0)
    assert view["prefix_cache_hits"] == 96 and view["prefix_cache_hit_rate"] == pytest.approx(0.25)
    printed = capsys.readouterr().out
    assert "Request goodput (req/s):" in printed and "Preemptions:" in printed


def test_request_rate_spaces_the_sends_by_the_seeded_gamma_gaps(tmp_path):
    prompts = [f"r{i}" for i in range(5)]
    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.005) as server:
        result = serve.main(_args("--base-url", server.url, "--dataset-name", "jsonl",
                                  "--dataset-path", _jsonl(tmp_path, prompts), "--num-prompts", "5",
                                  "--jsonl-output-len", "2", "--request-rate", "20", "--burstiness", "2",
                                  "--seed", "3", "--disable-tqdm"))
    gaps = serve.arrival_gaps(5, 20.0, 2.0, 3)
    expected = [sum(gaps[:i + 1]) for i in range(5)]
    for got, want in zip(result["start_times"], expected):
        assert want * 1000 - 1 <= got * 1000 <= want * 1000 + LATE_MS


def test_arrival_gaps():
    assert serve.arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    import numpy as np

    for burstiness in (0.5, 1.0, 4.0):
        gaps = np.asarray(serve.arrival_gaps(20000, 8.0, burstiness, 0))
        assert gaps.mean() == pytest.approx(1 / 8, rel=0.03)  # the rate holds whatever the burstiness
        assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1 / burstiness, rel=0.06)  # gamma: CV^2 = 1/k
    assert serve.arrival_gaps(4, 2.0, 1.0, 7) == serve.arrival_gaps(4, 2.0, 1.0, 7)


def test_errors_are_counted_and_reported_with_their_first_messages(tmp_path, capsys):
    prompts = ["e0", "FAIL e1", "e2", "FAIL e3"]
    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.005) as server:
        code = cli(["bench", "serve", "--base-url", server.url, "--dataset-name", "jsonl", "--dataset-path",
                    _jsonl(tmp_path, prompts), "--num-prompts", "4", "--jsonl-output-len", "2", "--disable-tqdm",
                    "--save-result", "--result-filename", str(tmp_path / "r.json")])
    assert code == 1  # some requests failed
    out = capsys.readouterr().out
    assert "Failed requests:" in out and "2 x HTTP 500:" in out and "injected failure" in out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert (saved["completed"], saved["failed"]) == (2, 2)
    assert [bool(e) for e in saved["errors"]] == [False, True, False, True]


def test_unreachable_server_is_one_clear_line(tmp_path, capsys):
    code = cli(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--dataset-name", "jsonl",
                "--dataset-path", _jsonl(tmp_path, ["x"]), "--num-prompts", "1", "--disable-tqdm"])
    assert code == 1
    err = capsys.readouterr().err
    assert "error: cannot reach the server at http://127.0.0.1:" in err and "Traceback" not in err


def test_chat_endpoint_without_usage_counts_chunks_and_saves_vllm_keys_and_plots(tmp_path, capsys):
    prompts = [f"c{i}" for i in range(3)]
    with FakeOpenAIServer(ttft_s=0.02, itl_s=0.01, send_usage=False, metrics_prefix="vllm:") as server:
        code = cli(["bench", "serve", "--base-url", server.url, "--backend", "openai-chat", "--model", "m",
                    "--dataset-name", "jsonl", "--dataset-path", _jsonl(tmp_path, prompts), "--num-prompts", "3",
                    "--jsonl-output-len", "4", "--ignore-eos", "--save-result", "--result-dir", str(tmp_path / "res"),
                    "--result-filename", "out.json", "--metadata", "run=ci", "--plot", str(tmp_path / "plots")])
        body = server.bodies[-1]
    assert code == 0
    assert body["model"] == "m" and body["stream"] and body["ignore_eos"] and body["max_completion_tokens"] == 4
    assert body["messages"][0]["role"] == "user"
    saved = json.loads((tmp_path / "res" / "out.json").read_text())
    for key in ("completed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "ttfts", "itls", "input_lens", "output_lens",
                "errors", "max_concurrent_requests"):
        assert key in saved, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in saved
    assert saved["output_lens"] == [4, 4, 4] and saved["run"] == "ci"
    assert saved["server_metrics"]["num_preemptions"] == 6  # read under vLLM's names
    for png in ("latency_cdf.png", "timeline.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"


def test_tokens_without_text_count_when_usage_says_so(tmp_path):
    """Tokens that decode to nothing (special tokens skipped) still succeed; TTFT is the first chunk's."""
    for usage, completed in ((True, 2), (False, 0)):
        with FakeOpenAIServer(ttft_s=0.03, itl_s=0.01, text="", send_usage=usage) as server:
            result = serve.main(_args("--base-url", server.url, "--dataset-name", "jsonl", "--dataset-path",
                                      _jsonl(tmp_path, ["x0", "x1"]), "--num-prompts", "2", "--jsonl-output-len",
                                      "3", "--disable-tqdm"))
        assert result["completed"] == completed
        if usage:
            assert result["output_lens"] == [3, 3] and _near(result["mean_ttft_ms"], 30)
        else:
            assert result["errors"] == ["the stream ended without any generated text"] * 2


def test_bad_flags_are_clear_errors(capsys):
    assert cli(["bench", "serve", "--goodput", "latency:5", "--disable-tqdm"]) == 2
    assert "--goodput 'latency:5'" in capsys.readouterr().err
    assert cli(["bench", "serve", "--max-concurrency", "0"]) == 2
    assert cli(["bench", "serve", "--backend", "openai-chat", "--prompt-format", "token-ids"]) == 2
    assert "token-ids needs --endpoint /v1/completions" in capsys.readouterr().err


def test_goodput_parsing_and_metrics_on_hand_made_results():
    assert serve_metrics.parse_goodput(["ttft:200", "tpot:50", "e2el:1000"]) == {"ttft": 200, "tpot": 50, "e2el": 1000}
    with pytest.raises(ValueError, match="not a number"):
        serve_metrics.parse_goodput(["ttft:fast"])
    R = serve_metrics.RequestResult
    results = [R(success=True, prompt_len=10, output_tokens=5, ttft=0.1, itl=[0.05] * 4, latency=0.3, start_time=0.0),
               R(success=True, prompt_len=10, output_tokens=1, ttft=0.2, itl=[], latency=0.2, start_time=0.1),
               R(success=False, error="boom", start_time=0.5, latency=0.1)]
    m = serve_metrics.compute_metrics(results, 2.0, [50, 99], {"ttft": 150}, start=0.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 20, 6)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0 and m["total_token_throughput"] == 13.0
    assert m["mean_ttft_ms"] == pytest.approx(150) and m["median_ttft_ms"] == pytest.approx(150)
    assert m["mean_tpot_ms"] == pytest.approx(50)  # (0.3 - 0.1) / 4; the 1-token request has no TPOT
    assert m["p99_itl_ms"] == pytest.approx(50) and m["mean_e2el_ms"] == pytest.approx(250)
    assert m["request_goodput"] == 0.5 and m["max_concurrent_requests"] == 2
    assert m["total_cached_tokens"] is None and m["cached_token_share"] is None  # no usage details: unknown
    results[0].usage = {"prompt_tokens_details": {"cached_tokens": 5}}
    results[1].usage = {"prompt_tokens_details": None}
    m = serve_metrics.compute_metrics(results, 2.0, [50], {}, start=0.0)
    assert m["total_cached_tokens"] == 5 and m["cached_token_share"] == 5 / 20


def test_server_metrics_parsing_pagedserve_and_vllm_names():
    text = ("# TYPE vllm:num_preemptions counter\n"
            'vllm:num_preemptions_total{model_name="m"} 3.0\n'
            "# TYPE pagedserve:prefix_cache_queries counter\npagedserve:prefix_cache_queries_total 10\n"
            "# TYPE other_metric counter\nother_metric_total 99\n")
    assert serve_metrics.parse_server_metrics(text) == {"num_preemptions": 3.0, "prefix_cache_queries": 10.0}
    view = serve_metrics.server_view({"num_preemptions": 1.0}, {"num_preemptions": 3.0})
    assert view["num_preemptions"] == 2.0
    assert serve_metrics.server_view(None, {"num_preemptions": 3.0}) is None
