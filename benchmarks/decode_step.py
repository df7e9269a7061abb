"""Where one steady decode step's time goes, by part, for a batch of N sequences on the default model.

    python benchmarks/decode_step.py --num-seqs 256      # W1's decode batch
    python benchmarks/decode_step.py --num-seqs 16       # what max concurrency 16 decodes

Adds N requests of 128 random prompt ids (W1's prompts), runs until every prompt is computed, then times
--steps decode steps with wall-clock timers around the C kernels (decode attention, RoPE + KV write,
RMSNorm, SwiGLU where it is not fused into the gate/up matmul), the sampler and, with --time-linear, the
matmuls (the packed kernel's calls, the one ending in SwiGLU, and torch's F.linear where a layer uses it).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--time-linear", action="store_true")
    args = parser.parse_args()

    import pagedserve.attention.cpu_decode as cpu_decode
    import pagedserve.kernels.fused_ops as fused_ops
    import pagedserve.kernels.skinny_gemm as skinny_gemm
    import pagedserve.layers.linear as linear
    from pagedserve.benchmarks.throughput import make_prompts
    from pagedserve.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    llm = LLM(dtype=args.dtype)
    engine = llm.engine
    # Long enough that the first prompts, which decode while later ones prefill, are still running.
    params = SamplingParams(max_tokens=args.steps + 64, ignore_eos=True, temperature=0)
    for i, prompt in enumerate(make_prompts(args.num_seqs, 128, 49152, 0)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(2):
        engine.step()

    seconds: dict[str, float] = collections.defaultdict(float)

    def timed(module, name: str, label: str) -> None:
        inner = getattr(module, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                seconds[label] += time.perf_counter() - start

        setattr(module, name, wrapper)

    timed(cpu_decode, "decode_attention", "decode attention (C)")
    timed(fused_ops, "rotary_and_cache", "RoPE + KV write (C)")
    timed(fused_ops, "rms_norm", "RMSNorm + residual (C)")
    timed(linear, "silu_and_mul", "SwiGLU, not fused (C or torch)")
    timed(type(engine.runner.sampler), "__call__", "sampler")
    if args.time_linear:
        timed(skinny_gemm, "linear", "matmuls, packed kernel")
        timed(skinny_gemm, "linear_swiglu", "gate/up matmul + SwiGLU, packed")
        timed(linear.F, "linear", "matmuls, torch")
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    running = engine.scheduler.running
    context = sum(r.num_computed_tokens for r in running) / len(running)
    print(f"decode step: {step_ms:.1f} ms ({len(running)} sequences, mean context {context:.0f})")
    for label, total in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {label:34s} {total / args.steps * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
