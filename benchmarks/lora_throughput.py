"""Multi-LoRA throughput offline: output tok/s and TPOT with 0, 1, 4 and 16 distinct adapters in flight.

W1's shape (random prompt ids of --input-len -> exactly --output-len tokens, greedy, all queued at once) on
the default model, --max-num-seqs requests at a time. The adapters are random rank --rank LoRAs on all 7
linear modules, written here in the PEFT format (adapter_config.json + adapter_model.safetensors), request i
using adapter i mod N. Rows:

- "LoRA off": an engine without enable_lora (the baseline);
- "0 adapters": the LoRA engine running base-model requests only (what enable_lora costs when unused);
- "0 adapters, no C layers": the same with the C decode-layers path turned off, which is what every step
  with a LoRA row pays (that path calls no Python Linear, so it cannot add the deltas);
- "N adapters": N distinct adapters through --max-loras slots (N > max_loras: they take turns, and only the
  requests of max_loras adapters run at once, so the batch is smaller).

Every case runs --repeats times, interleaved, and the table gives each case's median run.

    python benchmarks/lora_throughput.py                        # 64 x 128 -> 128, max_num_seqs=16, max_loras=4
    python benchmarks/lora_throughput.py --num-requests 8 --input-len 16 --output-len 8 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from pagedserve import LoRARequest, SamplingParams
from pagedserve.benchmarks.cpu_kind import cpu_kind
from pagedserve.benchmarks.throughput import make_prompts
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.lora.targets import PARENTS, TARGET_MODULES, lora_shapes


def write_peft_adapter(path: str, shapes, rank: int, seed: int) -> str:
    """A random LoRA on all 7 modules of every layer, as peft's save_pretrained lays it out."""
    os.makedirs(path, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module in TARGET_MODULES:
            in_features, out_features = shapes.features[module]
            prefix = f"base_model.model.model.layers.{layer}.{PARENTS[module]}.{module}"
            a = torch.randn(rank, in_features, generator=generator) / in_features ** 0.5
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
              "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def run_case(engine: LLMEngine, args, loras: list, seed: int) -> dict:
    """All requests queued at once; request i runs with loras[i % len(loras)] (no adapters: base model)."""
    vocab = engine.loaded.hf_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = make_prompts(args.num_requests, args.input_len, vocab, seed)
    engine.reset_prefix_cache()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(f"{seed}-{i}", {"prompt_token_ids": prompt}, params, lora_request=lora)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    elapsed = time.perf_counter() - start
    tpots = [(o.metrics.finished_time - o.metrics.first_token_time) / (args.output_len - 1) for o in outputs
             if args.output_len > 1]
    return {"elapsed_s": elapsed, "output_tok_s": args.num_requests * args.output_len / elapsed,
            "tpot_ms": 1000 * statistics.mean(tpots) if tpots else float("nan")}


def warm_up(engine: LLMEngine, loras: list) -> None:
    """One short request per adapter kind (kernels built, slots touched), untimed."""
    vocab = engine.loaded.hf_config.vocab_size
    for i, lora in enumerate(loras[:1] or [None]):
        engine.add_request(f"warm-{i}", {"prompt_token_ids": make_prompts(1, 8, vocab, 99)[0]},
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), lora_request=lora)
    while engine.has_unfinished_requests():
        engine.step()


def engine_kwargs(args, **lora) -> dict:
    return dict(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                max_model_len=args.input_len + args.output_len + 16, **lora)


def measure(args, adapter_dir: str) -> list[tuple[str, dict]]:
    """Every case --repeats times, the cases interleaved (machine noise spreads over all of them); the median
    run of each case."""
    counts = [int(c) for c in args.adapters.split(",")]
    base = LLMEngine.from_kwargs(**engine_kwargs(args))
    engine = LLMEngine.from_kwargs(**engine_kwargs(args, enable_lora=True, max_loras=args.max_loras,
                                                   max_lora_rank=args.rank,
                                                   max_cpu_loras=max(counts + [args.max_loras])))
    shapes = lora_shapes(engine.runner.model)
    loras = [LoRARequest(f"random-{i}", i + 1, write_peft_adapter(os.path.join(adapter_dir, str(i)), shapes,
                                                                  args.rank, i)) for i in range(max(counts))]
    for lora in loras:
        engine.add_lora(lora)
    warm_up(base, [])
    warm_up(engine, loras)
    cases = [("LoRA off", base, [], True)]
    for count in counts:
        if count == 0:
            cases += [("0 adapters", engine, [], True), ("0 adapters, no C layers", engine, [], False)]
        else:
            cases.append((f"{count} adapter{'s' if count > 1 else ''}", engine, loras[:count], True))
    runs: dict[str, list[dict]] = {name: [] for name, *_ in cases}
    for repeat in range(args.repeats):
        for seed, (name, on, adapters, c_layers) in enumerate(cases):
            model = on.runner.model
            saved = model._decode_layers
            if not c_layers:
                model._decode_layers = None  # what a step with a LoRA row runs
            runs[name].append(run_case(on, args, adapters, 1000 * repeat + seed))
            model._decode_layers = saved
    return [(name, sorted(r, key=lambda x: x["output_tok_s"])[len(r) // 2]) for name, r in runs.items()]


def table(rows: list[tuple[str, dict]]) -> str:
    baseline = rows[0][1]["output_tok_s"]
    lines = ["| case | out tok/s | vs LoRA off | mean TPOT (ms) |", "|---|---|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['output_tok_s']:.1f} | {r['output_tok_s'] / baseline:.3f}x | "
                     f"{r['tpot_ms']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", default="0,1,4,16", help="distinct adapter counts to run, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="runs of each case (interleaved); the median is shown")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as adapter_dir:
        rows = measure(args, adapter_dir)
    for name, r in rows:
        print(json.dumps({"case": name, **r}), flush=True)
    print(f"\nCPU: {cpu_kind()}; {args.num_requests} requests x {args.input_len} -> {args.output_len} tokens, "
          f"greedy, max_num_seqs={args.max_num_seqs}, max_loras={args.max_loras}, rank {args.rank} on all 7 "
          f"modules\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_kind(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
