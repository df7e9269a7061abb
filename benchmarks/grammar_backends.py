"""xgrammar against llguidance on the default model's tokenizer: compile time and per-token mask cost for one
nested JSON schema, walking a valid document token by token (the measurement behind pagedserve's choice of
xgrammar; llguidance is not a dependency: `pip install llguidance` to run this).

    python benchmarks/grammar_backends.py
"""

from __future__ import annotations

import json
import statistics
import time

from pagedserve.benchmarks.cpu_kind import cpu_kind
from pagedserve.loader.model_loader import default_model_path, open_checkpoint

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOCUMENT = {"name": "Alice Smith", "age": 33, "tags": ["a", "c"], "address": {"city": "Paris", "zip": "75001"}}


def xgrammar_case(tokenizer, vocab: int) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), max_threads=2)
    tables = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - start
    matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)
    times = []
    for token in tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False):  # xgrammar: ", " and ": "
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - start)
        assert matcher.accept_token(token)
    return {"tables_s": tables, "compile_s": compile_s, "mask_ms": times}


def llguidance_case(tokenizer, vocab: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    tables = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(lltokenizer, grammar)
    compile_s = time.perf_counter() - start
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times = []
    compact = json.dumps(DOCUMENT, separators=(",", ":"))  # llguidance without flexible whitespace: "," and ":"
    for token in tokenizer.encode(compact, add_special_tokens=False):
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        times.append(time.perf_counter() - start)
        assert matcher.consume_token(token), matcher.get_error()
    return {"tables_s": tables, "compile_s": compile_s, "mask_ms": times}


def main() -> None:
    tokenizer = open_checkpoint(default_model_path()).tokenizer()
    vocab = 49152
    print(f"CPU: {cpu_kind()}\n\n| library | tokenizer tables (ms) | compile (ms) | mask per token, mean (ms) | "
          "max (ms) |\n|---|---|---|---|---|")
    for name, case in (("xgrammar", xgrammar_case), ("llguidance", llguidance_case)):
        r = case(tokenizer, vocab)
        masks = [1000 * t for t in r["mask_ms"]]
        print(f"| {name} | {1000 * r['tables_s']:.0f} | {1000 * r['compile_s']:.1f} | {statistics.mean(masks):.3f} | "
              f"{max(masks):.3f} |")


if __name__ == "__main__":
    main()
