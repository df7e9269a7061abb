"""Throughput and per-tenant finish times of the scheduling policies, side by side, offline on the default model.

W1's shape (random prompt ids of --input-len -> exactly --output-len tokens, greedy, all at once), split between
tenants: by default a flood tenant with 200 requests and two small ones with 40 and 16, queued flood first.
Each policy gets a fresh engine in this process, in rotating order, --repeats times; the table gives median
output tok/s, the ratio to fcfs measured in the same run, and when each tenant's last request finished.

    python benchmarks/scheduling_policies.py --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from pagedserve import SamplingParams
from pagedserve.benchmarks.cpu_kind import cpu_kind
from pagedserve.benchmarks.throughput import make_prompts
from pagedserve.engine.llm_engine import LLMEngine

POLICIES = ("fcfs", "fair", "priority")


def run_once(args, policy: str, tenants: dict[str, int]) -> dict:
    engine = LLMEngine.from_kwargs(model=args.model, dtype=args.dtype, scheduling_policy=policy,
                                   max_model_len=args.input_len + args.output_len + 16)
    vocab = engine.loaded.hf_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm_up(engine, vocab)
    owner = {}
    start = time.perf_counter()
    for seed, (tenant, count) in enumerate(tenants.items()):
        for i, prompt in enumerate(make_prompts(count, args.input_len, vocab, seed)):
            request_id = f"{tenant}-{i}"
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params, tenant=tenant)
            owner[request_id] = tenant
    last_finish = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last_finish[owner[out.request_id]] = time.perf_counter() - start
    elapsed = time.perf_counter() - start
    result = {"policy": policy, "elapsed_s": elapsed,
              "output_tok_s": sum(tenants.values()) * args.output_len / elapsed,
              "last_finish_s": last_finish, "preemptions": engine.scheduler.num_preemptions_total}
    del engine
    gc.collect()
    return result


def warm_up(engine: LLMEngine, vocab: int) -> None:
    """One untimed request (kernels built, buffers touched), then a cold prefix cache."""
    engine.add_request("warm-up", {"prompt_token_ids": make_prompts(1, 8, vocab, 99)[0]},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()


def table(results: dict[str, list[dict]], tenants: dict[str, int]) -> str:
    fcfs = statistics.median(r["output_tok_s"] for r in results["fcfs"])
    lines = ["| policy | out tok/s (median) | vs fcfs | " + " | ".join(f"{t} ({n}) done at s" for t, n in
                                                                      tenants.items()) + " | preemptions |",
             "|---" * (4 + len(tenants)) + "|"]
    for policy, runs in results.items():
        tok_s = statistics.median(r["output_tok_s"] for r in runs)
        done = [statistics.median(r["last_finish_s"][t] for r in runs) for t in tenants]
        lines.append(f"| {policy} | {tok_s:.1f} | {tok_s / fcfs:.3f}x | " + " | ".join(f"{d:.1f}" for d in done)
                     + f" | {statistics.median(r['preemptions'] for r in runs):.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--tenants", default="flood=200,small=40,tiny=16", help="name=count,... queued in this order")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write every run here")
    args = p.parse_args()
    tenants = {name: int(count) for name, count in (part.split("=") for part in args.tenants.split(","))}
    results: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    for repeat in range(args.repeats):
        order = POLICIES[repeat % len(POLICIES):] + POLICIES[:repeat % len(POLICIES)]
        for policy in order:
            run = run_once(args, policy, tenants)
            print(json.dumps(run), flush=True)
            results[policy].append(run)
    print(f"\nCPU: {cpu_kind()}; {args.tenants}; {args.input_len} -> {args.output_len} tokens, greedy\n")
    print(table(results, tenants))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_kind(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
