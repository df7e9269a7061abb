"""`pagedserve bench serve --tenants`: spec parsing, per-tenant keys, priorities, schedules and metrics.

The load tests run against fake_openai_server.py with API keys on, so a request reaches it only with a
valid key, and the server's record of each request (arrival time, Authorization header, body) tells which
tenant sent it.
"""

from __future__ import annotations

import argparse
import json

import pytest

from fake_openai_server import FakeOpenAIServer
from pagedserve.benchmarks import serve, serve_report, serve_tenants
from pagedserve.benchmarks.serve_tenants import TenantSpec
from pagedserve.entrypoints.cli import main as cli

KEY_A, KEY_B = "key-a-secret", "key-b-secret"
LATE_MS = 25  # the fake server's sleeps and the client's sends may be late on a busy machine, never early


def _args(*argv: str) -> argparse.Namespace:
    return serve.add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))


def _jsonl(tmp_path, prompts: list[str]) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def _jsonl_flags(tmp_path, prompts: list[str], output_len: int = 2) -> list[str]:
    return ["--dataset-name", "jsonl", "--dataset-path", _jsonl(tmp_path, prompts), "--jsonl-output-len",
            str(output_len), "--disable-tqdm"]


def _received_by(server: FakeOpenAIServer, key: str) -> list[dict]:
    return [r for r in server.received if r["authorization"] == f"Bearer {key}"]


# ---------------------------------------------------------------------------------------------------------
# Parsing


def test_tenant_spec_parses_every_accepted_key():
    spec = serve_tenants.parse_tenant_spec(
        "name=chat, api_key=K,num_prompts=15,request_rate=0.5,burstiness=2,max_concurrency=4,"
        "random_input_len=64,random_output_len=8,arrivals=uniform,priority=-1")
    assert spec == TenantSpec(name="chat", api_key="K", num_prompts=15, request_rate=0.5, burstiness=2.0,
                              max_concurrency=4, random_input_len=64, random_output_len=8, arrivals="uniform",
                              priority=-1)
    assert serve_tenants.parse_tenant_spec("name=flood,request_rate=inf").request_rate == float("inf")


def test_tenant_spec_leaves_unset_keys_to_the_global_flags():
    spec = serve_tenants.parse_tenant_spec("name=solo,num_prompts=3")
    assert (spec.api_key, spec.priority, spec.arrivals) == (None, None, "poisson")
    own = serve_tenants.tenant_args(_args("--num-prompts", "50", "--request-rate", "4", "--seed", "10"), spec, 2)
    assert (own.num_prompts, own.request_rate, own.seed) == (3, 4.0, 12)  # seed + the tenant's index
    assert serve_tenants.auth_headers(spec) is None and serve_tenants.body_fields(spec) == {}


def test_tenant_spec_reads_the_key_from_the_named_environment_variable(monkeypatch):
    monkeypatch.setenv("BENCH_TENANT_KEY", "from-env")
    spec = serve_tenants.parse_tenant_spec("name=a,api_key_env=BENCH_TENANT_KEY")
    assert serve_tenants.auth_headers(spec) == {"Authorization": "Bearer from-env"}
    assert "from-env" not in repr(spec)


@pytest.mark.parametrize("spec, named", [
    ("num_prompts=3", "needs name=NAME"),
    ("name=a,colour=red", "unknown key 'colour'"),
    ("name=a,num_prompts", "'num_prompts' is not KEY=VALUE"),
    ("name=a,num_prompts=many", "num_prompts='many': not an integer"),
    ("name=a,num_prompts=0", "num_prompts='0': must be >= 1"),
    ("name=a,request_rate=0", "request_rate='0': must be > 0"),
    ("name=a,burstiness=inf", "burstiness='inf': must be > 0 and finite"),
    ("name=a,arrivals=bursty", "arrivals='bursty': must be one of poisson, uniform"),
    ("name=a,priority=high", "priority='high': not an integer"),
    ("name=a,priority=1,priority=2", "'priority' given twice"),
    ("name=a,api_key=K,api_key_env=V", "api_key or api_key_env, not both"),
    ("name=a,api_key_env=BENCH_UNSET_VARIABLE", "BENCH_UNSET_VARIABLE is not set"),
    ("name=a,api_key=", "api_key is empty"),
])
def test_malformed_tenant_spec_is_an_argparse_error_naming_the_bad_part(spec, named, capsys, monkeypatch):
    monkeypatch.delenv("BENCH_UNSET_VARIABLE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli(["bench", "serve", "--tenants", "name=ok", spec])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --tenants:" in err and named in err, err


def test_tenant_spec_errors_do_not_echo_the_api_key(capsys):
    with pytest.raises(SystemExit):
        cli(["bench", "serve", "--tenants", f"name=a,api_key={KEY_A},num_prompts=x"])
    err = capsys.readouterr().err
    assert "num_prompts='x'" in err and KEY_A not in err


def test_two_tenants_with_one_name_are_refused(capsys):
    assert cli(["bench", "serve", "--tenants", "name=a", "name=a,num_prompts=2"]) == 2
    assert "the name 'a' is given to two tenants" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# Arrivals


def test_uniform_arrivals_are_exactly_one_over_the_rate_apart_from_t0():
    assert serve.arrival_gaps(5, 0.5, 1.0, 0, "uniform") == [0.0, 2.0, 2.0, 2.0, 2.0]
    assert serve.arrival_gaps(3, 4.0, 0.3, 9, "uniform") == [0.0, 0.25, 0.25]  # burstiness and seed ignored
    assert serve.arrival_gaps(3, float("inf"), 1.0, 0, "uniform") == [0.0, 0.0, 0.0]
    assert serve.arrival_gaps(4, 2.0, 1.0, 7, "poisson") == serve.arrival_gaps(4, 2.0, 1.0, 7)  # the default


def test_tenant_lanes_draw_their_own_seeded_gaps_and_keep_their_own_cap(tmp_path):
    args = _args(*_jsonl_flags(tmp_path, ["p"]), "--seed", "5", "--tenants", "name=a,num_prompts=4,request_rate=3",
                 "name=b,num_prompts=3,request_rate=3,max_concurrency=2,arrivals=uniform")
    a, b = serve.tenant_lanes(args, None)
    assert a.gaps == serve.arrival_gaps(4, 3.0, 1.0, 5) and b.gaps == serve.arrival_gaps(3, 3.0, 1.0, 6, "uniform")
    assert (len(a.requests), a.max_concurrency, b.max_concurrency) == (4, None, 2)


# ---------------------------------------------------------------------------------------------------------
# Against the fake server


def test_each_tenants_requests_carry_its_own_key_priority_and_lengths(tiny_llama_dir):
    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.005, api_keys=(KEY_A, KEY_B)) as server:
        result = serve.main(_args(
            "--base-url", server.url, "--tokenizer", tiny_llama_dir, "--dataset-name", "random", "--prompt-format",
            "token-ids", "--random-input-len", "8", "--random-output-len", "3", "--disable-tqdm",
            "--tenants", f"name=a,api_key={KEY_A},num_prompts=3,priority=5,random_output_len=2",
            f"name=b,api_key={KEY_B},num_prompts=2,random_input_len=5"))
    assert (result["completed"], result["failed"]) == (5, 0)  # /v1/models and /metrics took a key too
    sent_a, sent_b = _received_by(server, KEY_A), _received_by(server, KEY_B)
    assert (len(sent_a), len(sent_b), len(server.received)) == (3, 2, 5)
    assert all(r["body"]["priority"] == 5 and r["body"]["max_tokens"] == 2 for r in sent_a)
    assert all("priority" not in r["body"] and r["body"]["max_tokens"] == 3 for r in sent_b)  # not given: not sent
    assert {len(r["body"]["prompt"]) for r in sent_a} == {8} and {len(r["body"]["prompt"]) for r in sent_b} == {5}
    assert result["server_metrics"] is not None


def test_result_json_has_per_tenant_counts_ttft_and_throughput(tmp_path, capsys):
    prompts = ["j0", "FAIL j1", "j2"]  # tenant a sends all three, tenant b the first one only
    with FakeOpenAIServer(ttft_s=0.03, itl_s=0.01, api_keys=(KEY_A, KEY_B), slow_keys={KEY_B: 0.1}) as server:
        code = cli(["bench", "serve", "--base-url", server.url, *_jsonl_flags(tmp_path, prompts, output_len=3),
                    "--metric-percentiles", "50,99.9", "--save-result", "--result-filename", str(tmp_path / "r.json"),
                    "--tenants", f"name=a,api_key={KEY_A},num_prompts=3", f"name=b,api_key={KEY_B},num_prompts=1"])
    assert code == 1  # one request failed
    text = (tmp_path / "r.json").read_text()
    saved = json.loads(text)
    a, b = saved["tenants"]["a"], saved["tenants"]["b"]
    assert (a["completed"], a["failed"], b["completed"], b["failed"]) == (2, 1, 1, 0)
    assert (saved["completed"], saved["failed"], saved["num_prompts"]) == (3, 1, 4)
    for key in ("request_throughput", "output_throughput", "duration", "mean_ttft_ms", "median_ttft_ms",
                "p50_ttft_ms", "p99_9_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms"):
        assert key in a and key in b, key
    # the slow key's TTFT is its own: the server waits 100 ms more before b's first chunk (b's one request shares the
    # fake server's and the client's event loops with a's three, so on a busy machine it ran 34 ms late once: CI)
    assert 30 - 1 <= a["mean_ttft_ms"] <= 30 + LATE_MS and 130 - 1 <= b["mean_ttft_ms"] <= 130 + 3 * LATE_MS
    assert a["request_throughput"] == pytest.approx(2 / a["duration"])
    assert b["output_throughput"] == pytest.approx(3 / b["duration"])
    assert saved["request_tenants"] == ["a", "a", "a", "b"] and saved["errors"][1].startswith("HTTP 500")
    assert KEY_A not in text and KEY_B not in text
    out = capsys.readouterr().out
    assert "Per tenant (TTFT, TPOT in ms)" in out and "P99_9" in out
    assert [line.split()[:3] for line in out.splitlines() if line.startswith(("a ", "b "))] == [
        ["a", "2", "1"], ["b", "1", "0"]]


def test_uniform_tenant_sends_one_over_rate_apart_while_a_flood_tenant_sends_at_once(tmp_path):
    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.005, api_keys=(KEY_A, KEY_B)) as server:
        result = serve.main(_args("--base-url", server.url, *_jsonl_flags(tmp_path, ["u0", "u1", "u2", "u3"]),
                                  "--tenants",
                                  f"name=flood,api_key={KEY_A},num_prompts=4,request_rate=inf",
                                  f"name=steady,api_key={KEY_B},num_prompts=4,request_rate=10,arrivals=uniform"))
    flood_starts, steady_starts = result["start_times"][:4], result["start_times"][4:]
    assert all(t * 1000 <= LATE_MS for t in flood_starts)
    for i, t in enumerate(steady_starts):  # due at 0, 100, 200, 300 ms
        assert 100 * i - 1 <= t * 1000 <= 100 * i + LATE_MS, (i, t)
    arrivals = [r["time"] for r in _received_by(server, KEY_B)]
    for earlier, later in zip(arrivals, arrivals[1:]):
        assert 100 - LATE_MS <= (later - earlier) * 1000 <= 100 + LATE_MS
    # the run lasts until the steady tenant's last request is done, the flood tenant's part much less
    assert result["duration"] >= result["tenants"]["steady"]["duration"] >= 0.3
    assert result["tenants"]["flood"]["duration"] < 0.3


def test_a_tenants_max_concurrency_caps_only_its_own_requests(tmp_path):
    with FakeOpenAIServer(ttft_s=0.03, itl_s=0.01) as server:
        result = serve.main(_args("--base-url", server.url, *_jsonl_flags(tmp_path, ["c0", "c1", "c2"]), "--tenants",
                                  "name=capped,num_prompts=3,max_concurrency=1", "name=free,num_prompts=3"))
        assert all(r["authorization"] is None for r in server.received)  # no key given: no header
    assert result["tenants"]["capped"]["max_concurrent_requests"] == 1
    assert result["tenants"]["free"]["max_concurrent_requests"] == 3
    assert result["tenants"]["capped"]["max_concurrency"] == 1 and result["max_concurrency"] == "per-tenant"


def test_without_tenants_no_key_no_priority_and_no_tenant_keys(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.005) as server:
        result = serve.main(_args("--base-url", server.url, *_jsonl_flags(tmp_path, ["n0", "n1"]),
                                  "--num-prompts", "2"))
        assert [r["authorization"] for r in server.received] == [None, None]
        assert all("priority" not in r["body"] for r in server.received)
    assert "tenants" not in result and "request_tenants" not in result
    assert result["num_prompts"] == 2 and result["request_rate"] == "inf" and result["max_concurrency"] is None
    assert "Per tenant" not in capsys.readouterr().out
    assert serve_report.default_filename(result).startswith("openai-infqps-fake-model-")


def test_tenant_result_file_is_named_after_the_tenants():
    result = {"backend": "openai", "model_id": "org/m", "date": "D", "tenants": {"flood": {}, "chat/1": {}}}
    assert serve_report.default_filename(result) == "openai-tenants-flood+chat_1-m-D.json"


def test_api_key_flag_or_openai_api_key_env_authorizes_every_request(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.005, api_keys=[KEY_A, KEY_B]) as server:
        flags = ["--base-url", server.url, *_jsonl_flags(tmp_path, ["k0", "k1"]), "--num-prompts", "2"]
        assert serve.main(_args(*flags, "--api-key", KEY_A))["completed"] == 2
        monkeypatch.setenv("OPENAI_API_KEY", KEY_B)
        assert serve.main(_args(*flags))["completed"] == 2
        # A tenant's own key wins over the global one for its requests.
        serve.main(_args(*flags, "--tenants", f"name=own,api_key={KEY_A},num_prompts=1", "name=shared,num_prompts=1"))
    assert [r["authorization"] for r in server.received[:4]] == [f"Bearer {KEY_A}"] * 2 + [f"Bearer {KEY_B}"] * 2
    assert sorted(r["authorization"] for r in server.received[4:]) == [f"Bearer {KEY_A}", f"Bearer {KEY_B}"]
