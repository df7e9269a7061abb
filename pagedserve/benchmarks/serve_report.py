"""The printed report, the result JSON and the PNG charts of `pagedserve bench serve`."""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter

from pagedserve.benchmarks.serve_metrics import RequestResult, token_times

TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
WIDTH = 50
MAX_ERRORS_SHOWN = 3


def _pct_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else f"{p:g}".replace(".", "_")


def print_report(result: dict, metrics: list[str], percentiles: list[float], out=None) -> None:
    out = out or sys.stdout
    def row(name: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{name:<40}{text:>10}", file=out)

    def section(title: str) -> None:
        print(f"{title:-^{WIDTH}}", file=out)

    print(f"{' Serving Benchmark Result ':=^{WIDTH}}", file=out)
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    rate = result["request_rate"]
    row("Request rate (req/s):", rate if isinstance(rate, str) else float(rate))
    row("Maximum request concurrency:", result["max_concurrency"] or "none")
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", float(result["max_output_tokens_per_s"]))
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    if result.get("cached_token_share") is not None:
        row("Prompt tokens from the prefix cache (%):", 100 * result["cached_token_share"])
    for m in metrics:
        section(TITLES[m])
        row(f"Mean {m.upper()} (ms):", result[f"mean_{m}_ms"])
        row(f"Median {m.upper()} (ms):", result[f"median_{m}_ms"])
        for p in percentiles:
            row(f"P{_pct_label(p)} {m.upper()} (ms):", result[f"p{_pct_label(p)}_{m}_ms"])
    server = result.get("server_metrics")
    if server:
        section("Server's view (/metrics, during the run)")
        if "mean_queue_time_ms" in server:
            row("Mean queue time (ms):", server["mean_queue_time_ms"])
        if "mean_ttft_ms" in server:
            row("Mean TTFT, server side (ms):", server["mean_ttft_ms"])
        if "num_preemptions" in server:
            row("Preemptions:", int(server["num_preemptions"]))
        if "prefix_cache_queries" in server:
            row("Prefix cache hits / queries (tokens):",
                f"{int(server['prefix_cache_hits'])}/{int(server['prefix_cache_queries'])}")
            if server["prefix_cache_hit_rate"] is not None:
                row("Prefix cache hit rate (%):", 100 * server["prefix_cache_hit_rate"])
    if result.get("tenants"):
        section("Per tenant (TTFT, TPOT in ms)")
        print_tenant_table(result["tenants"], percentiles, out)
    errors = [e for e in result["errors"] if e]
    if errors:
        section("Errors")
        for message, count in Counter(errors).most_common(MAX_ERRORS_SHOWN):
            print(f"{count} x {message}", file=out)
    print("=" * WIDTH, file=out)
    out.flush()


def print_tenant_table(tenants: dict, percentiles: list[float], out=None) -> None:
    """One row per tenant: its counts, its throughput (over its own duration), its TTFT (mean, median,
    percentiles) and mean TPOT in milliseconds."""
    out = out or sys.stdout
    ttft_keys = ["mean_ttft_ms", "median_ttft_ms"] + [f"p{_pct_label(p)}_ttft_ms" for p in percentiles]
    ttft_heads = ["TTFT mean", "median"] + [f"P{_pct_label(p)}" for p in percentiles]
    name_width = max(8, *(len(name) for name in tenants))
    heads = ["ok", "failed", "req/s", "out tok/s", *ttft_heads, "TPOT mean"]
    print(f"{'tenant':<{name_width}}" + "".join(f"{h:>11}" for h in heads), file=out)
    for name, t in tenants.items():
        values = [t["request_throughput"], t["output_throughput"], *(t[k] for k in ttft_keys), t["mean_tpot_ms"]]
        cells = [f"{t['completed']:>11}", f"{t['failed']:>11}"] + [f"{v:>11.2f}" for v in values]
        print(f"{name:<{name_width}}" + "".join(cells), file=out)


def default_filename(result: dict) -> str:
    if result.get("tenants"):
        model = str(result["model_id"]).rstrip("/").split("/")[-1]
        names = re.sub(r"[^A-Za-z0-9_.+-]", "_", "+".join(result["tenants"]))  # tenant names are free text
        return f"{result['backend']}-tenants-{names}-{model}-{result['date']}.json"
    conc = f"-concurrency{result['max_concurrency']}" if result["max_concurrency"] else ""
    model = str(result["model_id"]).rstrip("/").split("/")[-1]
    return f"{result['backend']}-{result['request_rate']}qps{conc}-{model}-{result['date']}.json"


def save_result(result: dict, args) -> str:
    name = args.result_filename or default_filename(result)
    path = os.path.join(args.result_dir, name) if args.result_dir else name
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def check_plotting() -> None:
    """Fail before the run, not after it, when --plot cannot work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'pagedserve[bench]'") from None


def plot(result: dict, results: list[RequestResult], start: float, out_dir: str) -> list[str]:
    """latency_cdf.png (TTFT, TPOT, ITL, E2E) and timeline.png (output tok/s and requests in flight per second)."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    os.makedirs(out_dir, exist_ok=True)
    ok = [r for r in results if r.success]
    series = {"TTFT": [r.ttft for r in ok], "TPOT": [r.tpot for r in ok if r.tpot is not None],
              "ITL": [x for r in ok for x in r.itl], "E2E latency": [r.latency for r in ok]}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series.items()):
        ms = np.sort(np.asarray(values) * 1000)
        if ms.size:
            ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post")
        ax.set_title(f"{name} CDF ({ms.size} values)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['model_id']}: {result['completed']} requests, rate {result['request_rate']}, "
                 f"max concurrency {result['max_concurrency'] or 'none'}")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "latency_cdf.png"), dpi=100)
    plt.close(fig)

    seconds = max(1, int(np.ceil(result["duration"])))
    tokens = np.zeros(seconds)
    in_flight = np.zeros(seconds)
    for r in ok:
        for t, n in token_times(r):
            tokens[min(seconds - 1, int(t - start))] += n
    grid = np.arange(seconds) + 0.5  # requests in flight at the middle of each second
    for r in results:
        s, e = r.start_time - start, r.start_time - start + r.latency
        in_flight += (grid >= s) & (grid < e)
    fig, ax1 = plt.subplots(figsize=(10, 4))
    ax1.plot(np.arange(seconds), tokens, label="output tok/s")
    ax1.set_xlabel("seconds since start")
    ax1.set_ylabel("output tokens / s")
    ax2 = ax1.twinx()
    ax2.plot(grid, in_flight, color="tab:orange", label="requests in flight")
    ax2.set_ylabel("requests in flight")
    fig.legend(loc="upper right")
    ax1.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "timeline.png"), dpi=100)
    plt.close(fig)
    return ["latency_cdf.png", "timeline.png"]
