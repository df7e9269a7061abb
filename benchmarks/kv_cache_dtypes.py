"""KV-cache dtypes side by side: W1 offline output tok/s, concurrency-16 TPOT, and how many 2,048-token
requests a 4 GiB cache holds, for auto (the model dtype) and each 8-bit KV dtype, on the default model.

Every engine is built once; the cases run interleaved --repeats times (machine noise spreads over all of
them) and the table gives each case's median run:

- W1: 256 x 128 random prompt ids -> exactly 128 tokens, greedy, all queued at once (--w1-requests);
- concurrency 16: 64 requests of the same shape with max_num_seqs 16, mean TPOT of the requests;
- capacity: blocks of a 4 GiB cache (--kv-cache-memory-bytes 4 GiB, which allocates lazily) x block_size /
  2,048, i.e. how many such requests fit at once.

    python benchmarks/kv_cache_dtypes.py [--repeats 2] [--dtype auto] [--kv-dtypes auto,int8,fp8_e4m3,fp8_e5m2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from pagedserve.benchmarks.cpu_kind import cpu_kind
from pagedserve.engine.llm_engine import LLMEngine

sys.path.insert(0, str(Path(__file__).parent))
from lora_throughput import run_case, warm_up  # noqa: E402

CAPACITY_BYTES = 4 << 30
CAPACITY_LEN = 2048


def capacity(dtype: str, kv_cache_dtype: str) -> int:
    """2,048-token requests that fit a 4 GiB cache at once."""
    engine = LLMEngine.from_kwargs(dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=CAPACITY_BYTES,
                                   max_model_len=CAPACITY_LEN)
    blocks, block_size = engine.runner.num_blocks, engine.core.config.cache_config.block_size
    return blocks * block_size // CAPACITY_LEN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-dtypes", default="auto,int8,fp8_e4m3,fp8_e5m2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--w1-requests", type=int, default=256)
    args = parser.parse_args()
    kv_dtypes = args.kv_dtypes.split(",")
    shape = argparse.Namespace(input_len=128, output_len=128)
    engines = {}
    for kv in kv_dtypes:
        common = dict(dtype=args.dtype, kv_cache_dtype=kv, max_model_len=256 + 16)
        engines[kv] = (LLMEngine.from_kwargs(**common, max_num_seqs=256), LLMEngine.from_kwargs(**common, max_num_seqs=16))
        for engine in engines[kv]:
            warm_up(engine, [])
    runs = {kv: {"w1": [], "c16": []} for kv in kv_dtypes}
    for repeat in range(args.repeats):
        for i, kv in enumerate(kv_dtypes):
            w1_engine, c16_engine = engines[kv]
            runs[kv]["w1"].append(run_case(w1_engine, argparse.Namespace(**vars(shape), num_requests=args.w1_requests),
                                           [], 100 * repeat + i))
            runs[kv]["c16"].append(run_case(c16_engine, argparse.Namespace(**vars(shape), num_requests=64), [],
                                            100 * repeat + 50 + i))
    dtype = engines[kv_dtypes[0]][0].runner.dtype
    print(f"# {cpu_kind()}; model dtype {dtype}; {args.repeats} interleaved runs per case, medians\n")
    print("| KV dtype | bytes per token | W1 out tok/s | vs auto | concurrency 16: out tok/s | mean TPOT (ms) "
          "| 2,048-token requests in 4 GiB | vs auto |")
    print("|---|---|---|---|---|---|---|---|")
    base_w1 = base_capacity = None
    for kv in kv_dtypes:
        w1 = statistics.median(r["output_tok_s"] for r in runs[kv]["w1"])
        c16 = sorted(runs[kv]["c16"], key=lambda r: r["output_tok_s"])[len(runs[kv]["c16"]) // 2]
        fits = capacity(args.dtype, kv)
        base_w1, base_capacity = base_w1 or w1, base_capacity or fits
        runner = engines[kv][0].runner
        per_token = runner.bytes_per_block // engines[kv][0].core.config.cache_config.block_size
        print(f"| {kv} ({str(runner.kv_cache_dtype).removeprefix('torch.')}) | {per_token} | {w1:.1f} | "
              f"{w1 / base_w1:.3f}x | {c16['output_tok_s']:.1f} | {c16['tpot_ms']:.1f} | {fits} | "
              f"{fits / base_capacity:.2f}x |")
    print("\nW1 runs:", {kv: [round(r["output_tok_s"], 1) for r in runs[kv]["w1"]] for kv in kv_dtypes})


if __name__ == "__main__":
    main()
