"""Prefix routing vs round-robin on the Ray app, and the ingress's own cost, side by side in one run.

Workload: `pagedserve bench serve --dataset-name prefix`: --num-prefixes groups of requests; a group's requests
share a --prefix-len-token prefix and end in their own --suffix-len tokens, groups interleaved; --output-len
tokens each (ignore_eos), --max-concurrency in flight. It runs against `pagedserve serve --ray --num-replicas 2`
once per router, in two cache sizes: the default (every replica can hold every prefix) and one that holds
--small-cache-fraction of the groups' tokens per replica (the case a router is for: caches smaller than the set
of prefixes). Rounds alternate the routers. Then the ingress's cost: TTFT of one request at a time (short
random prompts) through `pagedserve serve` and through `--ray --num-replicas 1`.

    python benchmarks/ray_routing.py --dtype auto            # the default model, about 12 minutes on 2 cores
    python benchmarks/ray_routing.py --model tiny-dir --num-prompts 8 --num-prefixes 2 --prefix-len 32 \\
        --rounds 1   # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import urllib.request

from compare_serving import add_server_flags, start_server, stop_server  # same folder
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.benchmarks import serve
from pagedserve.benchmarks.cpu_kind import cpu_kind


def bench(args, url: str, name: str, extra: list[str]) -> dict:
    argv = ["--base-url", url, "--prompt-format", "token-ids", "--ignore-eos", "--seed", str(args.seed),
            "--label", name, "--save-result", "--result-dir", args.output_dir, "--result-filename",
            f"{name}.json", "--disable-tqdm", "--metric-percentiles", "50,99", *extra]
    if args.model:
        argv += ["--tokenizer", args.model]
    print(f"\n### {name}: pagedserve bench serve {' '.join(argv)}", flush=True)
    return serve.main(serve.add_cli_args(argparse.ArgumentParser()).parse_args(argv))


def prefix_load(args) -> list[str]:
    return ["--dataset-name", "prefix", "--num-prompts", str(args.num_prompts),
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.output_len), "--max-concurrency", str(args.max_concurrency)]


def bytes_per_token(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "pagedserve:cache_config_info":
            labels = family.samples[0].labels
            return int(labels["bytes_per_block"]) / int(labels["block_size"])
    raise SystemExit("no pagedserve:cache_config_info on /metrics")


def run(args, name: str, server_flags: list[str], load: list[str],
        measure_cache: bool = False) -> tuple[dict, float]:
    """One server up, one bench run, the server down; with measure_cache, its KV bytes per token too."""
    args.server_arg = args.server_extra + server_flags
    proc, url = start_server(args, os.path.join(args.output_dir, f"server_{name}.log"))
    try:
        result = bench(args, url, name, load)
        return result, bytes_per_token(url) if measure_cache else 0.0
    finally:
        stop_server(proc)


def routing_rows(args) -> list[tuple[str, str, str, dict]]:
    """(router, cache, round, result) for both routers in both cache sizes, every round."""
    per_group = args.prefix_len + args.num_prompts // args.num_prefixes * (args.suffix_len + args.output_len)
    small_cache_bytes = None
    rows = []
    for round_ in range(1, args.rounds + 1):
        for cache in ("default", "small"):
            for router in ("round-robin", "prefix"):
                flags = ["--ray", "--num-replicas", "2", "--router", router]
                if router == "prefix" and args.imbalance_threshold is not None:
                    flags += ["--router-imbalance-threshold", str(args.imbalance_threshold)]
                if cache == "small":
                    flags += ["--kv-cache-memory-bytes", str(small_cache_bytes)]
                result, per_token = run(args, f"{router}_{cache}_{round_}", flags, prefix_load(args),
                                        measure_cache=small_cache_bytes is None)
                if small_cache_bytes is None:
                    small_cache_bytes = int(args.small_cache_fraction * args.num_prefixes * per_group * per_token)
                    print(f"small cache: {small_cache_bytes} bytes per replica "
                          f"({args.small_cache_fraction:g} of the groups' {args.num_prefixes * per_group} tokens)")
                rows.append((router, cache, str(round_), result))
    return rows


def overhead_rows(args) -> list[tuple[str, str, dict]]:
    """(server, round, result): one short request at a time through the single server and the Ray app."""
    load = ["--dataset-name", "random", "--num-prompts", str(args.overhead_prompts), "--random-input-len", "64",
            "--random-output-len", "4", "--max-concurrency", "1", "--num-warmups", "2"]
    rows = []
    for round_ in range(1, args.rounds + 1):
        rows.append(("pagedserve serve", str(round_), run(args, f"single_{round_}", [], load)[0]))
        # The replica gets every core, as the single server's engine does (Ray gives an actor one thread per CPU).
        rows.append(("pagedserve serve --ray --num-replicas 1", str(round_),
                     run(args, f"ray1_{round_}", ["--ray", "--num-replicas", "1", "--ray-cpus-per-replica",
                                                  str(os.cpu_count())], load)[0]))
    return rows


def report(args, routing: list, overhead: list) -> None:
    if routing:
        routing_report(routing)
    if overhead:
        overhead_report(overhead)


def routing_report(routing: list) -> None:
    print(f"\n## Prefix routing vs round-robin ({cpu_kind()})\n")
    print("| router | cache | round | prompt tokens from cache | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s |")
    print("|---|---|---|---|---|---|---|")
    for router, cache, round_, r in routing:
        share = r.get("cached_token_share")
        print(f"| {router} | {cache} | {round_} | {'n/a' if share is None else f'{100 * share:.1f}%'} | "
              f"{r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['output_throughput']:.1f} |")
    for cache in ("default", "small"):
        pairs = [(rr, px) for (a, c1, n1, rr) in routing for (b, c2, n2, px) in routing
                 if a == "round-robin" and b == "prefix" and c1 == c2 == cache and n1 == n2]
        ratios = [rr["median_ttft_ms"] / px["median_ttft_ms"] for rr, px in pairs]
        print(f"\nTTFT p50, round-robin / prefix, {cache} cache: "
              + ", ".join(f"{x:.2f}x" for x in ratios) + f" (median {statistics.median(ratios):.2f}x)")


def overhead_report(overhead: list) -> None:
    print("\n## The ingress's cost: one request at a time\n")
    print("| server | round | TTFT p50 (ms) | TTFT p99 (ms) | E2E p50 (ms) |")
    print("|---|---|---|---|---|")
    for server, round_, r in overhead:
        print(f"| {server} | {round_} | {r['median_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | "
              f"{r['median_e2el_ms']:.1f} |")
    singles = {n: r for s, n, r in overhead if "--ray" not in s}
    rays = {n: r for s, n, r in overhead if "--ray" in s}
    print("\nTTFT p50, Ray app / single server: " + ", ".join(
        f"{rays[n]['median_ttft_ms'] / singles[n]['median_ttft_ms']:.2f}x "
        f"(+{rays[n]['median_ttft_ms'] - singles[n]['median_ttft_ms']:.1f} ms)" for n in sorted(singles)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_flags(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--small-cache-fraction", type=float, default=0.75,
                   help="the small cache holds this share of all the groups' tokens, per replica")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--imbalance-threshold", type=int, default=None,
                   help="--router-imbalance-threshold of the prefix runs (default: the server's)")
    p.add_argument("--parts", default="routing,overhead", help="which comparisons to run")
    p.add_argument("--overhead-prompts", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--output-dir", default="ray_routing_results")
    args = p.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    print(f"CPU: {cpu_kind()}", flush=True)
    parts = args.parts.split(",")
    report(args, routing_rows(args) if "routing" in parts else [],
           overhead_rows(args) if "overhead" in parts else [])


if __name__ == "__main__":
    main()
