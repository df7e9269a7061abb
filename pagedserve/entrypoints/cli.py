"""`pagedserve` command line: generate text, serve the OpenAI API, run benchmarks."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedserve.entrypoints.engine_args import add_engine_args, engine_kwargs


def _add_generate(subparsers) -> None:
    p = subparsers.add_parser("generate", help="Print a completion of a prompt (default model when --model is omitted).",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompt", help="The prompt text.")
    p.add_argument("--chat", action="store_true", help="Treat the prompt as a user message and apply the chat template.")
    p.add_argument("--system", default=None, help="System message (with --chat).")
    p.add_argument("--max-tokens", type=int, default=128, help="Most tokens to generate.")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None, help="Seed of this request's sampling.")
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedserve import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        [output] = llm.chat(messages, params, use_tqdm=False)
    else:
        [output] = llm.generate(args.prompt, params, use_tqdm=False)
    print(output.outputs[0].text)
    return 0


def _add_serve(subparsers) -> None:
    p = subparsers.add_parser("serve", help="Run the OpenAI-compatible HTTP server (default model when --model is "
                              "omitted).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 for every interface).")
    p.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    p.add_argument("--api-key", action="append", default=None,
                   help="Require `Authorization: Bearer <key>` on every route but /health. Repeat for several "
                        "keys. Default: the PAGEDSERVE_API_KEY environment variable, else no auth.")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="Name(s) clients use in `model`; the first is reported in responses and metrics. "
                        "Default: the --model argument (the default model's file name when omitted).")
    p.add_argument("--max-num-queued-requests", type=int, default=None,
                   help="Most requests waiting to be scheduled; more get 429 with Retry-After. Default: no limit.")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="Largest `logprobs` (completions) / `top_logprobs` (chat) a request may ask for.")
    p.add_argument("--max-request-body-bytes", type=int, default=16 << 20,
                   help="Larger request bodies get 413.")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="On SIGTERM/SIGINT: seconds in-flight requests may take to finish before they are aborted.")
    p.add_argument("--disable-log-requests", action="store_true", help="Do not log each request.")
    add_engine_args(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.openai.server import serve

    return serve(args)


def _add_bench(subparsers) -> None:
    p = subparsers.add_parser("bench", help="Benchmarks.")
    kinds = p.add_subparsers(dest="bench_kind", required=True)
    t = kinds.add_parser("throughput", help="Offline throughput (W1: 256 x 128 random ids -> 128 tokens), "
                         "side by side with Hugging Face transformers static batching.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from pagedserve.benchmarks import throughput

    throughput.add_cli_args(t)
    t.set_defaults(func=lambda a: (throughput.main(a), 0)[1])
    s = kinds.add_parser("serve", help="Load an OpenAI-compatible server and measure TTFT, TPOT, ITL, E2E latency, "
                         "throughput and goodput (vLLM's flags and result keys).",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from pagedserve.benchmarks import serve

    serve.add_cli_args(s)
    s.set_defaults(func=serve.cli_main)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="High-throughput LLM inference engine.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    _add_serve(subparsers)
    _add_bench(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
