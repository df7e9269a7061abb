"""W1 (256 requests, 128 in / 128 out) and concurrency 16 (64 requests) on the default model in bf16, with the
pagedserve of the checkout given (so that two commits can be measured alternately on one machine); prints one
JSON line: resident weights, W1 output tok/s, c16 mean TPOT.

    git worktree add /tmp/before <commit>
    for i in 1 2; do for d in /tmp/before .; do python benchmarks/checkout_ab.py $d; done; done
"""
import argparse, json, sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/benchmarks")
import torch
from lora_throughput import run_case, warm_up
from gguf_weights import weight_bytes
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.loader.model_loader import default_model_path
import pagedserve
common = dict(model=default_model_path(), dtype="bfloat16", max_model_len=272, skip_tokenizer_init=True)
w1 = LLMEngine.from_kwargs(**common, max_num_seqs=256, kv_cache_memory_bytes=2048 << 20)
c16 = LLMEngine.from_kwargs(**common, max_num_seqs=16, kv_cache_memory_bytes=256 << 20)
for e in (w1, c16): warm_up(e, [])
shape = dict(input_len=128, output_len=128)
a = run_case(w1, argparse.Namespace(**shape, num_requests=256), [], 1)
b = run_case(c16, argparse.Namespace(**shape, num_requests=64), [], 2)
print(json.dumps({"code": pagedserve.__file__, "weights_mib": round(weight_bytes(w1) / 2**20, 1),
                  "w1_tok_s": round(a["output_tok_s"], 1), "c16_tpot_ms": round(b["tpot_ms"], 2)}))
