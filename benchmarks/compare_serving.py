"""Serve the W1 workload through `pagedserve serve` two ways: all requests at once, and 16 at a time.

Starts `pagedserve serve` (default model unless --model) on a free port, waits for /health, then runs
`pagedserve bench serve` twice on the throughput benchmark's workload W1: the same 256 prompts of 128 random
token ids (`pagedserve.benchmarks.throughput.make_prompts`, seed 0), each asking for exactly 128 tokens
(ignore_eos, greedy), sent as token ids to /v1/completions:

  (a) all 256 requests at once (--request-rate inf);
  (b) at most 16 in flight (--max-concurrency 16).

Each scenario gets a freshly started server, so that the second never finds the first one's prompts in the
prefix cache. Each run's JSON (vLLM's keys) goes to --output-dir; a markdown table of both is printed at the
end. The servers' stdout/stderr go to OUTPUT_DIR/server_<scenario>.log.

    python benchmarks/compare_serving.py --dtype bfloat16
    python benchmarks/compare_serving.py --model tiny-dir --num-prompts 8 --input-len 8 --output-len 4  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from pagedserve.benchmarks import serve, throughput

COLUMNS = [("completed", "ok", "{:d}"), ("duration", "duration s", "{:.1f}"),
           ("request_throughput", "req/s", "{:.2f}"), ("output_throughput", "out tok/s", "{:.1f}"),
           ("max_concurrent_requests", "peak conc.", "{:d}"), ("median_ttft_ms", "median TTFT ms", "{:.0f}"),
           ("p99_ttft_ms", "p99 TTFT ms", "{:.0f}"), ("median_tpot_ms", "median TPOT ms", "{:.1f}"),
           ("p99_itl_ms", "p99 ITL ms", "{:.1f}"), ("median_e2el_ms", "median E2E ms", "{:.0f}")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """The server flags of the scripts that start `pagedserve serve` once per scenario, adding their own flags
    (in `args.server_extra`) to each scenario's."""
    p.add_argument("--model", default=None, help="default: pagedserve's default model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--server-arg", dest="server_extra", action="append", default=[],
                   help="extra flag for pagedserve serve (repeat)")


def start_server(args, log_path: str) -> tuple[subprocess.Popen, str]:
    port = args.port or free_port()
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port), "--dtype", args.dtype,
           "--disable-log-requests", *args.server_arg]
    if args.model:
        cmd += ["--model", args.model]
    print("server:", " ".join(cmd), flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"pagedserve serve exited with {proc.returncode}; see {log_path}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit(f"pagedserve serve did not answer /health in {args.start_timeout} s; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def write_workload(args, path: str) -> None:
    from pagedserve.loader.model_loader import open_checkpoint

    vocab = int(open_checkpoint(args.model).config.vocab_size)
    with open(path, "w") as f:
        for ids in throughput.make_prompts(args.num_prompts, args.input_len, vocab, args.seed):
            f.write(json.dumps({"prompt": ids, "output_len": args.output_len}) + "\n")


def run_scenario(url: str, workload: str, args, name: str, extra: list[str]) -> dict:
    argv = ["--base-url", url, "--dataset-name", "jsonl", "--dataset-path", workload,
            "--num-prompts", str(args.num_prompts), "--ignore-eos", "--seed", str(args.seed),
            "--num-warmups", str(args.num_warmups), "--label", name,
            "--save-result", "--result-dir", args.output_dir, "--result-filename", f"{name}.json", *extra]
    print(f"\n### {name}: pagedserve bench serve {' '.join(argv)}", flush=True)
    return serve.main(serve.add_cli_args(argparse.ArgumentParser()).parse_args(argv))


def markdown(rows: list[tuple[str, dict]]) -> str:
    lines = ["| load | " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, r in rows:
        cells = [fmt.format(int(r[k]) if fmt == "{:d}" else r[k]) for k, _, fmt in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: pagedserve's default model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for pagedserve serve (repeat)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--output-dir", default="serving_results")
    args = p.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    workload = os.path.join(args.output_dir, "workload.jsonl")
    write_workload(args, workload)
    scenarios = [(f"all {args.num_prompts} at once", "all_at_once", []),
                 (f"max concurrency {args.max_concurrency}", f"concurrency{args.max_concurrency}",
                  ["--max-concurrency", str(args.max_concurrency)])]
    rows = []
    for label, name, extra in scenarios:
        proc, url = start_server(args, os.path.join(args.output_dir, f"server_{name}.log"))
        try:
            rows.append((label, run_scenario(url, workload, args, name, extra)))
        finally:
            stop_server(proc)
    table = markdown(rows)
    print("\n" + table)
    with open(os.path.join(args.output_dir, "table.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
