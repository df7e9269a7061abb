"""Flags and entry point of `pagedserve bench soak`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from typing import Optional

from pagedserve.benchmarks.soak.mix import MixConfig
from pagedserve.benchmarks.soak.report import render, summary_dict
from pagedserve.benchmarks.soak.runner import SoakConfig, SoakRunner


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server")
    g.add_argument("--serve-args", default=None,
                   help="start `pagedserve serve` with these flags (one string) on a free local port, check its "
                        "processes, and stop it with SIGTERM at the end (which must exit 0)")
    g.add_argument("--base-url", default=None, help="a running server instead (e.g. http://127.0.0.1:8000)")
    g.add_argument("--server-pid", type=int, default=None,
                   help="with --base-url: the server's pid on this machine, for the RSS/threads/fds checks")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as `Authorization: Bearer KEY` (default: env OPENAI_API_KEY)")
    g.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    load = parser.add_argument_group("load")
    load.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    load.add_argument("--warmup", type=float, default=10.0, help="seconds of warm-up (measures capacity)")
    load.add_argument("--warmup-concurrency", type=int, default=32)
    load.add_argument("--request-rate", type=float, default=None,
                      help="requests/s of the load (default: --overload x the measured capacity)")
    load.add_argument("--overload", type=float, default=2.0)
    load.add_argument("--max-tokens", type=int, default=48, help="upper bound of the random max_tokens")
    load.add_argument("--disconnect-fraction", type=float, default=0.10)
    load.add_argument("--malformed-fraction", type=float, default=0.05)
    load.add_argument("--greedy-fraction", type=float, default=0.30,
                      help="share of requests that repeat a greedy probe (checked against it run alone)")
    load.add_argument("--seed", type=int, default=0)
    checks = parser.add_argument_group("checks")
    checks.add_argument("--request-timeout", type=float, default=300.0,
                        help="a request without a complete reply by then is a violation (a hang)")
    checks.add_argument("--drain-timeout", type=float, default=1.0,
                        help="seconds within which running, waiting and KV usage must return to 0")
    checks.add_argument("--resource-tolerance", type=float, default=0.05,
                        help="how much RSS, threads and open fds may grow from the warm-up to the end")
    parser.add_argument("--result-file", default=None, help="write the summary as JSON here")
    return parser


def _validate(args) -> None:
    if (args.serve_args is None) == (args.base_url is None):
        raise ValueError("give exactly one of --serve-args (start a server) and --base-url (a running one)")
    if args.server_pid is not None and args.serve_args is not None:
        raise ValueError("--server-pid goes with --base-url (--serve-args knows its server's pid)")
    for name in ("duration", "warmup", "overload", "max_tokens", "request_timeout", "warmup_concurrency"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    for name in ("disconnect_fraction", "malformed_fraction", "greedy_fraction", "resource_tolerance"):
        if not 0 <= getattr(args, name) <= 1:
            raise ValueError(f"--{name.replace('_', '-')} must be between 0 and 1")


def _config(args, base_url: str, model: str, pid: Optional[int]) -> SoakConfig:
    mix = MixConfig(max_tokens=args.max_tokens, disconnect_fraction=args.disconnect_fraction,
                    malformed_fraction=args.malformed_fraction, greedy_fraction=args.greedy_fraction,
                    seed=args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return SoakConfig(base_url=base_url.rstrip("/"), model=model, headers=headers, duration=args.duration,
                      warmup=args.warmup, warmup_concurrency=args.warmup_concurrency,
                      request_rate=args.request_rate, overload=args.overload,
                      request_timeout=args.request_timeout, drain_timeout=args.drain_timeout,
                      resource_tolerance=args.resource_tolerance, server_pid=pid, mix=mix)


def _served_model(base_url: str, api_key: Optional[str]) -> str:
    import urllib.request

    request = urllib.request.Request(base_url.rstrip("/") + "/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"cannot read the served model from {base_url}/v1/models ({e}); pass --model") from None


def run(args) -> dict:
    """Run the soak (starting and stopping the server with --serve-args); the summary."""
    from pagedserve.benchmarks.cpu_kind import cpu_kind

    _validate(args)
    server = None
    if args.serve_args is not None:
        from pagedserve.benchmarks.soak.launcher import LaunchedServer

        server = LaunchedServer(args.serve_args, os.path.join(tempfile.gettempdir(), f"soak-server-{os.getpid()}.log"))
    base_url = server.url if server is not None else args.base_url
    try:
        model = args.model or _served_model(base_url, args.api_key)
        runner = SoakRunner(_config(args, base_url, model, server.pid if server else args.server_pid),
                            log=lambda line: print(line, file=sys.stderr, flush=True))
        base = {"cpu_kind": cpu_kind(), "server": args.serve_args or base_url, "model": model,
                "warmup_s": args.warmup, "commit": _commit()}
        base.update(asyncio.run(runner.run()))
    finally:
        if server is not None:
            code = server.stop()
    summary = summary_dict(base, runner.tally, runner.warmup_tally)
    if server is not None:
        summary["server_exit_code"] = code
        if code != 0:
            summary["violations"] += 1
            summary["violation_samples"].append(f"the server exited {code} on SIGTERM (log: {server.log_path})")
    return summary


def _commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or None
    except OSError:
        return None


def cli_main(args) -> int:
    summary = run(args)
    print(render(summary))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["violations"] == 0 else 1
