"""Structured output: grammar compile time, the per-step token-mask cost, and throughput with every request
constrained to a JSON schema against none, on the default model.

1. Compile: the tokenizer tables (once per engine), then each schema cold (first time) and cached.
2. Mask cost per step at 1, 16 and 64 constrained rows: filling the rows' bitmask from their matchers (each
   part-way into a JSON document) and applying it to the logits, as a step does; and applying alone at 16 rows
   with the C kernel, with torch (the fallback) and with xgrammar's apply_token_bitmask_inplace.
3. Throughput: --num-requests chat requests asking for a JSON list, --max-num-seqs at a time, greedy,
   --output-len tokens at most, all under a JSON schema vs none (free requests ignore EOS so that both write
   about as many tokens); cases interleaved, median of --repeats.

    python benchmarks/structured_output.py
    python benchmarks/structured_output.py --num-requests 4 --output-len 8 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedserve import SamplingParams
from pagedserve.benchmarks.cpu_kind import cpu_kind
from pagedserve.config import StructuredOutputsConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.structured_output import StructuredOutputsParams
from pagedserve.kernels import token_bitmask
from pagedserve.structured_output.bitmask import apply_grammar_bitmask, apply_with_torch
from pagedserve.structured_output.grammar import GrammarCompiler
from pagedserve.structured_output.manager import StructuredOutputManager

LIST_SCHEMA = {"type": "object", "properties": {"cities": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                     "population": {"type": "integer", "minimum": 0}},
    "required": ["name", "country", "population"], "additionalProperties": False}}},
    "required": ["cities"], "additionalProperties": False}
PERSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                             "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                     "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "address"], "additionalProperties": False}
PREFIX = '{"cities": [{"name": "Paris", "country": "France", "population": 2100000}, {"name": "'


def compile_times(tokenizer, vocab: int, eos) -> list[tuple[str, float]]:
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab, eos)
    rows = [("tokenizer tables (once per engine)", time.perf_counter() - start)]
    for name, schema in (("city-list schema", LIST_SCHEMA), ("person schema (format, pattern, enum, bounds)",
                                                             PERSON_SCHEMA)):
        for state in ("cold", "cached"):
            start = time.perf_counter()
            compiler.compile(StructuredOutputsParams(json=schema))
            rows.append((f"{name}, {state}", time.perf_counter() - start))
    return rows


class _Row:  # what StructuredOutputManager.bitmask reads of a request
    def __init__(self, request_id: str, state) -> None:
        self.request_id, self.structured_output = request_id, state


def _constrained_rows(tokenizer, vocab: int, eos, rows: int):
    """(manager, `rows` requests part-way into a city-list document, their ids)."""
    manager = StructuredOutputManager(StructuredOutputsConfig(), lambda: tokenizer, vocab, eos)
    states = [manager.submit(StructuredOutputsParams(json=LIST_SCHEMA)) for _ in range(rows)]
    prefix = tokenizer.encode(PREFIX, add_special_tokens=False)
    requests = []
    for i, state in enumerate(states):
        state.future.result()
        assert state.ready
        for token in prefix[:len(prefix) - (i % 5)]:  # rows at slightly different places
            assert state.matcher.accept_token(token)
        requests.append(_Row(str(i), state))
    return manager, requests, [r.request_id for r in requests]


def mask_cost(tokenizer, vocab: int, eos, rows: int, steps: int = 50) -> float:
    """Mean ms per step to fill and apply the bitmask of `rows` constrained rows."""
    manager, requests, ids = _constrained_rows(tokenizer, vocab, eos, rows)
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16)
    start = time.perf_counter()
    for _ in range(steps):
        apply_grammar_bitmask(logits, ids, manager.bitmask(requests))
    manager.shutdown()
    return 1000 * (time.perf_counter() - start) / steps


def apply_costs(tokenizer, vocab: int, eos, rows: int = 16, steps: int = 50) -> list[tuple[str, float]]:
    """Mean ms to apply one step's bitmask of `rows` rows to bf16 logits, by each way of doing it."""
    import xgrammar as xgr

    manager, requests, _ = _constrained_rows(tokenizer, vocab, eos, rows)
    bitmask = manager.bitmask(requests).bitmask
    manager.shutdown()
    logits, all_rows = torch.randn(rows, vocab, dtype=torch.bfloat16), list(range(rows))
    ways = [("torch (unpack bits, masked_fill)", lambda: apply_with_torch(logits, bitmask, all_rows)),
            ("xgrammar apply_token_bitmask_inplace", lambda: xgr.apply_token_bitmask_inplace(logits, bitmask))]
    if token_bitmask.applies(logits):
        ways.insert(0, ("C kernel (kernels/csrc/token_bitmask.c)",
                        lambda: token_bitmask.apply_token_bitmask(logits, bitmask, all_rows)))
    out = []
    for name, apply in ways:
        apply()  # warm up (builds the C library once)
        start = time.perf_counter()
        for _ in range(steps):
            apply()
        out.append((name, 1000 * (time.perf_counter() - start) / steps))
    return out


def run_case(engine: LLMEngine, args, constrained: bool, seed: int) -> dict:
    tokenizer = engine.tokenizer
    constraint = StructuredOutputsParams(json=LIST_SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=not constrained,
                            structured_outputs=constraint)
    start = time.perf_counter()
    for i in range(args.num_requests):
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"List {20 + i % 30} large cities as JSON "
                                               "with name, country and population."}], tokenize=False,
                                             add_generation_prompt=True)
        engine.add_request(f"{seed}-{i}", {"prompt": text, "prompt_token_ids": tokenizer.encode(text)}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    elapsed = time.perf_counter() - start
    tokens = [len(o.outputs[0].token_ids) for o in outputs]
    tpots = [(o.metrics.finished_time - o.metrics.first_token_time) / (n - 1) for o, n in zip(outputs, tokens) if n > 1]
    return {"elapsed_s": elapsed, "output_tok_s": sum(tokens) / elapsed, "mean_output_len": statistics.mean(tokens),
            "tpot_ms": 1000 * statistics.mean(tpots)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-throughput", action="store_true", help="only the compile and mask tables")
    args = p.parse_args()
    engine = LLMEngine.from_kwargs(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                                   max_model_len=512)
    tokenizer, vocab, eos = engine.tokenizer, engine.core.info.vocab_size, engine.core.info.eos_token_ids
    print(f"CPU: {cpu_kind()}; {torch.get_num_threads()} threads\n\n| compile | ms |\n|---|---|")
    for name, seconds in compile_times(tokenizer, vocab, eos):
        print(f"| {name} | {1000 * seconds:.2f} |")
    print("\n| constrained rows | mask fill + apply, ms per step |\n|---|---|")
    for rows in (1, 16, 64):
        print(f"| {rows} | {mask_cost(tokenizer, vocab, eos, rows):.3f} |")
    print("\n| applying 16 rows' bitmask (bf16 logits) | ms |\n|---|---|")
    for name, ms in apply_costs(tokenizer, vocab, eos):
        print(f"| {name} | {ms:.3f} |")
    if args.skip_throughput:
        return
    run_case(engine, argparse.Namespace(**{**vars(args), "num_requests": 4, "output_len": 8}), True, -1)  # warm up
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for repeat in range(args.repeats):
        for constrained in (False, True):
            runs[constrained].append(run_case(engine, args, constrained, 10 * repeat + constrained))
    medians = {k: sorted(v, key=lambda r: r["output_tok_s"])[len(v) // 2] for k, v in runs.items()}
    for k, r in medians.items():
        print(json.dumps({"constrained": k, **r}))
    base = medians[False]["output_tok_s"]
    print(f"\n{args.num_requests} chat requests, max_num_seqs={args.max_num_seqs}, greedy, <= {args.output_len} "
          f"tokens, median of {args.repeats}\n\n| requests | out tok/s | vs none | mean TPOT (ms) | mean output tokens |"
          "\n|---|---|---|---|---|")
    for label, k in (("none constrained", False), ("all under a JSON schema", True)):
        r = medians[k]
        print(f"| {label} | {r['output_tok_s']:.1f} | {r['output_tok_s'] / base:.3f}x | {r['tpot_ms']:.1f} | "
              f"{r['mean_output_len']:.1f} |")


if __name__ == "__main__":
    main()
