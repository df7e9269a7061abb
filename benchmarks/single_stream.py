"""Single-stream decode speed of pagedserve: one request, 128 prompt token ids -> 256 tokens, greedy.

Prints one JSON line: decode_tok_s (tokens after the first / time after the first token: what llama-bench's
tg measures), prefill_s (arrival to first token), the dtype in force and the CPU kind. Median of --runs after
one warm-up request. benchmarks/compare_engines.py --single-stream runs it beside `llama-bench`.

    python benchmarks/single_stream.py --dtype auto --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics

from pagedserve import LLM, SamplingParams
from pagedserve.benchmarks.throughput import make_prompts
from pagedserve.benchmarks.cpu_kind import cpu_kind


def one_run(llm: LLM, prompt: list[int], output_len: int) -> tuple[float, float]:
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    m = out.metrics
    assert len(out.outputs[0].token_ids) == output_len
    return (output_len - 1) / (m.finished_time - m.first_token_time), m.first_token_time - m.arrival_time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, help="e.g. gguf: compute from the GGUF file's weights as stored")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
              max_model_len=args.input_len + args.output_len + 16)
    prompt = make_prompts(1, args.input_len, llm.engine.loaded.hf_config.vocab_size, 0)[0]
    one_run(llm, prompt, 8)  # warm-up: kernels built, buffers touched
    runs = [one_run(llm, prompt, args.output_len) for _ in range(args.runs)]
    print(json.dumps({"engine": "pagedserve", "dtype": str(llm.engine.loaded.dtype).removeprefix("torch."),
                      "quantization": args.quantization,
                      "cpu": cpu_kind(), "decode_tok_s": statistics.median(r[0] for r in runs),
                      "runs_decode_tok_s": [round(r[0], 1) for r in runs],
                      "prefill_s": statistics.median(r[1] for r in runs)}))


if __name__ == "__main__":
    main()
