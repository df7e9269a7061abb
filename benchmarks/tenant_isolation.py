"""A flood tenant beside an interactive one, under each scheduling policy: the interactive tenant's TTFT.

For each of `--scheduling-policy fcfs, priority, fair` a fresh `pagedserve serve` (default model unless --model)
gets one keys file with two user tenants: `flood` (default priority 10) and `interactive` (default priority 0;
fcfs ignores both). `pagedserve bench serve --tenants` then sends, from t=0: the flood tenant's --flood requests
all at once, and the interactive tenant's --interactive requests exactly --interval seconds apart. Every request
is random token ids of --input-len -> exactly --output-len tokens (ignore_eos, greedy). The table gives the
interactive tenant's TTFT (median, p99), the flood tenant's output tok/s and the total, per policy.

    python benchmarks/tenant_isolation.py --output-dir /tmp/tenants
    python benchmarks/tenant_isolation.py --model tiny-dir --flood 8 --interactive 2 --interval 0.5  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from compare_serving import start_server, stop_server
from pagedserve.benchmarks import serve
from pagedserve.benchmarks.cpu_kind import cpu_kind
from pagedserve.tenants.keys_file import add_tenant
from pagedserve.tenants.tenant import Tenant, hash_key, new_key

POLICIES = ("fcfs", "priority", "fair")


def write_keys_file(path: str) -> dict[str, str]:
    """Two user tenants with fresh random keys; returns name -> key (the file holds only their hashes)."""
    if os.path.exists(path):
        os.remove(path)
    keys = {}
    for name, priority in (("flood", 10), ("interactive", 0)):
        keys[name] = new_key()
        add_tenant(path, Tenant(name, hash_key(keys[name]), priority=priority, min_priority=priority))
    return keys


def run_policy(args, policy: str, keys: dict[str, str], keys_path: str) -> dict:
    args.server_arg = ["--api-keys-file", keys_path, "--scheduling-policy", policy, *args.extra_server_arg]
    proc, url = start_server(args, os.path.join(args.output_dir, f"server_{policy}.log"))
    try:
        os.environ["FLOOD_KEY"], os.environ["INTERACTIVE_KEY"] = keys["flood"], keys["interactive"]
        argv = ["--base-url", url, "--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len), "--ignore-eos", "--metric-percentiles", "50,99",
                "--disable-tqdm", "--save-result", "--result-dir", args.output_dir,
                "--result-filename", f"{policy}.json", "--tenants",
                f"name=flood,api_key_env=FLOOD_KEY,num_prompts={args.flood},request_rate=inf",
                f"name=interactive,api_key_env=INTERACTIVE_KEY,num_prompts={args.interactive},"
                f"request_rate={1 / args.interval},arrivals=uniform"]
        print(f"\n### {policy}: pagedserve bench serve {' '.join(argv)}", flush=True)
        return serve.main(serve.add_cli_args(argparse.ArgumentParser()).parse_args(argv))
    finally:
        stop_server(proc)


def table(results: dict[str, list[dict]]) -> str:
    def med(runs, tenant, key):
        return statistics.median(r["tenants"][tenant][key] for r in runs)

    lines = ["| policy | interactive TTFT median ms | interactive TTFT p99 ms | flood out tok/s | total out tok/s "
             "| failed |", "|---|---|---|---|---|---|"]
    for policy, runs in results.items():
        total = statistics.median(r["output_throughput"] for r in runs)
        failed = max(r["failed"] for r in runs)
        lines.append(f"| {policy} | {med(runs, 'interactive', 'median_ttft_ms'):.0f} | "
                     f"{med(runs, 'interactive', 'p99_ttft_ms'):.0f} | {med(runs, 'flood', 'output_throughput'):.1f}"
                     f" | {total:.1f} | {failed} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--start-timeout", type=float, default=120)
    p.add_argument("--flood", type=int, default=200)
    p.add_argument("--interactive", type=int, default=15)
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--extra-server-arg", action="append", default=[])
    p.add_argument("--output-dir", default="tenant_isolation_results")
    args = p.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    keys_path = os.path.join(args.output_dir, "keys.toml")
    keys = write_keys_file(keys_path)
    results: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    for repeat in range(args.repeats):
        for policy in POLICIES[repeat % 3:] + POLICIES[:repeat % 3]:
            results[policy].append(run_policy(args, policy, keys, keys_path))
    print(f"\nCPU: {cpu_kind()}; flood {args.flood} at once + interactive {args.interactive} every "
          f"{args.interval} s; {args.input_len} -> {args.output_len} tokens\n")
    print(table(results))
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump({"cpu": cpu_kind(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
