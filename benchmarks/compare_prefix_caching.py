"""Prefix caching on vs off, side by side: the same shared-prefix load against two `pagedserve serve` runs.

Workload (the issue's): 256 requests in 8 groups; the requests of a group share a 1,024-token prefix and end in
their own 64-token suffix; each asks for 32 tokens (ignore_eos); all are sent at once as token ids to
/v1/completions (`pagedserve bench serve --dataset-name prefix`). The server runs once with prefix caching
(the default) and once with --no-enable-prefix-caching; a markdown table of both is printed.

    python benchmarks/compare_prefix_caching.py --dtype bfloat16
    python benchmarks/compare_prefix_caching.py --model tiny-dir --num-prompts 8 --prefix-len 32 --suffix-len 4 \
        --output-len 2 --num-prefixes 2   # smoke
"""

from __future__ import annotations

import argparse
import os

from compare_serving import add_server_flags, markdown, start_server, stop_server  # same folder

from pagedserve.benchmarks import serve


def run(args, name: str, server_flags: list[str]) -> dict:
    args.server_arg = args.server_extra + server_flags
    proc, url = start_server(args, os.path.join(args.output_dir, f"server_{name}.log"))
    try:
        argv = ["--base-url", url, "--dataset-name", "prefix", "--prompt-format", "token-ids",
                "--num-prompts", str(args.num_prompts), "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len),
                "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                "--prefix-repetition-output-len", str(args.output_len), "--ignore-eos", "--seed", str(args.seed),
                "--num-warmups", "0", "--label", name, "--save-result", "--result-dir", args.output_dir,
                "--result-filename", f"{name}.json"]
        if args.model:
            argv += ["--tokenizer", args.model]
        print(f"\n### {name}: pagedserve bench serve {' '.join(argv)}", flush=True)
        return serve.main(serve.add_cli_args(argparse.ArgumentParser()).parse_args(argv))
    finally:
        stop_server(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_flags(p)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--output-dir", default="prefix_cache_results")
    args = p.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    rows = [("prefix caching on", run(args, "caching_on", [])),
            ("prefix caching off", run(args, "caching_off", ["--no-enable-prefix-caching"]))]
    table = markdown(rows)
    on, off = rows[0][1], rows[1][1]
    ratio = (f"\nTTFT p50 off/on: {off['median_ttft_ms'] / on['median_ttft_ms']:.1f}x; "
             f"p99 off/on: {off['p99_ttft_ms'] / on['p99_ttft_ms']:.1f}x; "
             f"output tok/s on/off: {on['output_throughput'] / off['output_throughput']:.2f}x")
    print("\n" + table + ratio)
    with open(os.path.join(args.output_dir, "table.md"), "w") as f:
        f.write(table + ratio + "\n")


if __name__ == "__main__":
    main()
