"""How much pagedserve's offline W1 loses when other processes want the cores: runs W1 with and without
background CPU hogs (busy loops at nice 19, like a batch job or a build on the same machine), alternating
configurations run by run, and prints tok/s per configuration and the ratio to the quiet run.

    python benchmarks/interference.py --runs 2                           # W1: 256 x 128 -> 128
    python benchmarks/interference.py --num-prompts 64 --output-len 32   # quick
    python benchmarks/interference.py --env GOMP_SPINCOUNT=10000000      # an OpenMP setting, both ways

Each configuration is `hogs x env`: --hogs (default "0,1") background processes, and with --env the run is
repeated with those variables set (compare the same hog count with and without them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from pagedserve.benchmarks.cpu_kind import cpu_kind

HOG = "import os\nos.nice(19)\nwhile True:\n    pass\n"


def run_w1(args, extra_env: dict, hogs: int) -> float:
    hog_procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "throughput", "--backend",
                   "pagedserve", "--dtype", args.dtype, "--num-prompts", str(args.num_prompts), "--input-len",
                   str(args.input_len), "--output-len", str(args.output_len), "--output-json", out]
            subprocess.run(cmd, check=True, env={**os.environ, **extra_env}, stdout=subprocess.DEVNULL)
            with open(out) as f:
                return json.load(f)["pagedserve"]["output_tok_s"]
    finally:
        for proc in hog_procs:
            proc.kill()
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--hogs", default="0,1", help="comma-separated numbers of nice-19 busy loops")
    p.add_argument("--env", nargs="*", default=[], help="NAME=VALUE settings to compare against none")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args()
    envs = [{}] + ([dict(kv.split("=", 1) for kv in args.env)] if args.env else [])
    configs = [(hogs, env) for env in envs for hogs in map(int, args.hogs.split(","))]
    results: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    for run in range(args.runs):
        for i in [(run + k) % len(configs) for k in range(len(configs))]:
            hogs, env = configs[i]
            results[i].append(run_w1(args, env, hogs))
            print(f"run {run + 1}: hogs={hogs} env={env or '-'}: {results[i][-1]:.1f} tok/s", flush=True)
    print(f"\nCPU: {cpu_kind()}; W1 {args.num_prompts} x {args.input_len} -> {args.output_len}, dtype {args.dtype}\n")
    print("| background hogs (nice 19) | env | out tok/s (median) | runs | vs quiet, same env |")
    print("|---|---|---|---|---|")
    for i, (hogs, env) in enumerate(configs):
        quiet = next(j for j, (h, e) in enumerate(configs) if h == 0 and e == env) if (0, env) in configs else None
        med = statistics.median(results[i])
        ratio = f"{med / statistics.median(results[quiet]):.2f}x" if quiet is not None else ""
        print(f"| {hogs} | {' '.join(f'{k}={v}' for k, v in env.items()) or '-'} | {med:.1f} | "
              f"{', '.join(format(r, '.0f') for r in results[i])} | {ratio} |")


if __name__ == "__main__":
    main()
