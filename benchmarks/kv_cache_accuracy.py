"""How much an 8-bit KV cache, or weights kept quantized, change the default model's outputs, on 100 real chat
prompts.

For each prompt (benchmarks/data/chat_prompts.txt, through the chat template) the model with the unquantized
cache (--kv-cache-dtype auto) writes a greedy continuation. Then every KV dtype reads prompt + continuation
in one prefill step (each token attends the cache, its own K/V included, exactly as a decode would); with
--quantization gguf so does the model computing from the GGUF file's weights as stored (activations rounded to
int8 per 32 where the CPU has int8 dot products), with the unquantized cache. At each continuation position we
compare its next-token distribution with the unquantized cache's:

- greedy agreement: how often its argmax is the unquantized cache's argmax at the same position of the same
  prefill (teacher-forced, so one early difference does not count again at every later position; the
  unquantized cache's own prefill argmax equals its decoded token at the share printed for "auto": the rest
  is bf16 rounding that differs between a prefill and a decode step);
- mean KL(p_auto || p_dtype) of the next-token distributions, in nats;
- free-running: each KV dtype also generates greedily on its own; the share of continuations identical to
  the unquantized cache's, and the mean share of tokens before the first difference.

    python benchmarks/kv_cache_accuracy.py [--max-tokens 64] [--dtype auto] [--kv-dtypes int8,fp8_e4m3,...]
    python benchmarks/kv_cache_accuracy.py --kv-dtypes "" --quantization gguf    # the weights alone
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.benchmarks.cpu_kind import cpu_kind

PROMPTS = Path(__file__).parent / "data" / "chat_prompts.txt"


class LogitsTap:
    """Keeps the last forward pass's hidden states (every row of the step), as logits, in float32."""

    def __init__(self, llm: LLM) -> None:
        self.model = llm.engine.runner.model
        self.logits = None
        self.model.register_forward_hook(self._keep)

    def _keep(self, module, inputs, hidden) -> None:
        self.logits = self.model.compute_logits(hidden).float()


def engine(kv_cache_dtype: str, dtype: str, quantization: str | None = None) -> LLM:
    return LLM(kv_cache_dtype=kv_cache_dtype, dtype=dtype, quantization=quantization, enable_prefix_caching=False,
               kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=2048, max_model_len=2048)


def teacher_forced(llm: LLM, tap: LogitsTap, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Log-probabilities [len(continuation), vocab] of each continuation token's position, from one prefill."""
    llm.generate([{"prompt_token_ids": prompt + continuation}], SamplingParams(max_tokens=1), use_tqdm=False)
    rows = tap.logits[len(prompt) - 1: len(prompt) + len(continuation) - 1]
    return torch.log_softmax(rows, dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="model dtype (activations)")
    parser.add_argument("--kv-dtypes", default="int8,fp8_e4m3,fp8_e5m2")
    parser.add_argument("--quantization", default=None, choices=["gguf"],
                        help="also compare the model computing from its GGUF weights as stored")
    parser.add_argument("--num-prompts", type=int, default=100)
    args = parser.parse_args()
    kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
    start = time.time()
    reference = engine("auto", args.dtype)
    tokenizer = reference.engine.tokenizer
    lines = [line.strip() for line in PROMPTS.read_text().splitlines() if line.strip()][: args.num_prompts]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": line}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for line in lines]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    continuations = [o.outputs[0].token_ids for o in reference.generate(inputs, greedy, use_tqdm=False)]
    engines = {d: engine(d, args.dtype) for d in kv_dtypes}
    if args.quantization:
        engines[f"weights kept (--quantization {args.quantization}), KV auto"] = engine("auto", args.dtype,
                                                                                      args.quantization)
    taps = {"auto": LogitsTap(reference), **{d: LogitsTap(e) for d, e in engines.items()}}
    agree = {d: 0 for d in engines}
    kl = {d: 0.0 for d in engines}
    positions = self_agree = 0
    for prompt, continuation in zip(prompts, continuations):
        ref = teacher_forced(reference, taps["auto"], prompt, continuation)
        target = ref.argmax(-1)
        positions += len(continuation)
        self_agree += int((target == torch.tensor(continuation)).sum())
        for d, llm in engines.items():
            lp = teacher_forced(llm, taps[d], prompt, continuation)
            agree[d] += int((lp.argmax(-1) == target).sum())
            kl[d] += float((ref.exp() * (ref - lp)).sum())
    print(f"# {cpu_kind()}; model dtype {reference.engine.runner.dtype}; {len(prompts)} chat prompts, "
          f"{args.max_tokens} greedy tokens each ({positions} positions)\n")
    print("| KV dtype or weights | blocks per GiB | greedy agreement (teacher-forced) | mean KL (nats) | "
          "identical continuations | tokens before first difference |")
    print("|---|---|---|---|---|---|")
    gib = 1 << 30
    print(f"| auto ({reference.engine.runner.kv_cache_dtype}) | {gib // reference.engine.runner.bytes_per_block} "
          f"| 1 (its decoded tokens: {self_agree / positions:.4f}) | 0 | 1 | 1 |")
    for d, llm in engines.items():
        free = [o.outputs[0].token_ids for o in llm.generate(inputs, greedy, use_tqdm=False)]
        identical = sum(a == b for a, b in zip(free, continuations)) / len(prompts)
        prefix = sum(_common_prefix(a, b) / max(len(b), 1) for a, b in zip(free, continuations)) / len(prompts)
        print(f"| {d} | {gib // llm.engine.runner.bytes_per_block} | {agree[d] / positions:.4f} | "
              f"{kl[d] / positions:.5f} | {identical:.2f} | {prefix:.3f} |")
    print(f"\n({time.time() - start:.0f} s)")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


if __name__ == "__main__":
    main()
