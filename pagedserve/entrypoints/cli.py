"""`pagedserve` command line: generate text, serve the OpenAI API, run benchmarks."""

from __future__ import annotations

import argparse
import sys

from pagedserve.entrypoints.config_file import expand_config_file
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


def _lora_module(text: str):
    from pagedserve.entrypoints.openai.lora_modules import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_serve(subparsers) -> None:
    p = subparsers.add_parser("serve", help="Run the OpenAI-compatible HTTP server (default model when --model is "
                              "omitted).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_serve_args(p)
    p.set_defaults(func=_run_serve)


def _serve_parser() -> argparse.ArgumentParser:
    """`pagedserve serve`'s flags on their own (what --config files are checked against)."""
    p = argparse.ArgumentParser(prog="pagedserve serve")
    _add_serve_args(p)
    return p


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE",
                   help="Read flags from this YAML file (keys: flag names without the dashes; true turns a switch "
                        "on). Flags on the command line win.")
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 for every interface).")
    p.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    p.add_argument("--api-key", action="append", default=None,
                   help="Require `Authorization: Bearer <key>` on every route but /health. Repeat for several "
                        "keys. Such keys have admin scope (tenant \"default\"). Default: the PAGEDSERVE_API_KEY "
                        "environment variable, else no auth.")
    p.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="Named tenants with hashed keys, scopes (admin/user), default priorities and rate limits: "
                        "TOML, or JSON when the name ends in .json (see `pagedserve keys add`). Re-read on SIGHUP; "
                        "a bad file is refused (at start: exit 2; on SIGHUP: the old keys stay).")
    p.add_argument("--max-metric-tenants", type=int, default=32,
                   help="Tenants with a label of their own in the per-tenant metrics; later ones count as "
                        "\"other\".")
    p.add_argument("--ssl-keyfile", default=None, help="Serve HTTPS with this private key (PEM).")
    p.add_argument("--ssl-certfile", default=None, help="Serve HTTPS with this certificate (PEM).")
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
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="Seconds an idle keep-alive connection stays open (uvicorn's).")
    p.add_argument("--timeout-request-headers", type=float, default=10.0,
                   help="Seconds a connection has to send a request's headers, from when it opened or its last "
                        "response ended; then it is closed (a client that sends nothing, or a byte at a time).")
    p.add_argument("--timeout-request-body", type=float, default=30.0,
                   help="Seconds a request's body may take to arrive, whole; then the answer is 408.")
    p.add_argument("--timeout-stream-write", type=float, default=30.0,
                   help="Seconds a response may wait on a client that stopped reading it (its socket buffers "
                        "full); then the connection is closed and its request aborted.")
    p.add_argument("--limit-concurrency", type=int, default=None,
                   help="Most connections and requests at once; beyond it new ones get 503 (uvicorn's). Default: "
                        "no limit.")
    p.add_argument("--restart-on-engine-failure", action=argparse.BooleanOptionalAction, default=True,
                   help="When the engine process dies, start a new one and serve again (requests in flight get "
                        "503; /health is 503 until it is back; counted in pagedserve:engine_restarts_total).")
    p.add_argument("--enable-fault-injection", action="store_true",
                   help="Add the admin route POST /debug/inject_fault ({\"fault\": \"step_error\"} or "
                        "\"kill\"), which makes the engine fail, to test recovery. Not for production.")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="Do not write the access log (a line per request, when its response is over).")
    _add_log_args(p)
    p.add_argument("--lora-modules", nargs="+", default=None, type=_lora_module, metavar="MODULE",
                   help="LoRA adapters to serve (needs --enable-lora), each `name=path` or JSON "
                        "'{\"name\": ..., \"path\": ...}'; a request selects one by putting its name in `model`.")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="Let requests use tool_choice auto (the default when they send tools): the model chooses "
                        "between text and tool calls, which are parsed out of its text.")
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                   help="How tool calls look in the model's text: hermes (<tool_call>{...}</tool_call>, also "
                        "pagedserve's own tool prompt for templates without tools) or llama3_json "
                        "({\"name\": ..., \"parameters\": ...}). Default: hermes.")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (admin keys only).")
    p.add_argument("--allowed-lora-dirs", nargs="+", default=None, metavar="DIR",
                   help="Directories POST /v1/load_lora_adapter may load adapters from (a lora_path elsewhere, "
                        "or with a symlink out, is a 400). Without it the route loads nothing.")
    _add_ray_args(p)
    add_engine_args(p)


def _add_log_args(p) -> None:
    from pagedserve.logging_utils import LOG_FORMATS, LOG_LEVELS

    g = p.add_argument_group("logging")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="Least severe level logged, by pagedserve, uvicorn and the engine-core process alike.")
    g.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="text: lines for people; json: one JSON object per line (time, level, logger, message "
                        "and, in the access log, request_id, tenant, model, lora_adapter, prompt_tokens, "
                        "completion_tokens, cached_tokens, ttft_s, e2e_s, finish_reason, status).")
    g.add_argument("--log-prompts", action="store_true",
                   help="Put prompt and completion text in the access log (default: token counts only).")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="With --log-prompts: characters (or token ids) of each prompt and completion kept. "
                        "Default: all.")


def _add_ray_args(p) -> None:
    from pagedserve.distributed.config import DEFAULT_TARGET_WAITING
    from pagedserve.distributed.routing_policy import ROUTER_POLICIES, RouterConfig

    g = p.add_argument_group("scale-out on Ray Serve (pip install 'pagedserve[ray]')")
    g.add_argument("--ray", action="store_true",
                   help="Serve through Ray Serve: one OpenAI ingress over --num-replicas engine replicas.")
    g.add_argument("--num-replicas", type=int, default=1, help="Engine replicas (with --ray).")
    g.add_argument("--ray-address", default=None,
                   help="The Ray cluster to join ('auto' for the one `ray start` began here); default: start one.")
    g.add_argument("--autoscale-min", type=int, default=None, help="Autoscale between this many replicas ...")
    g.add_argument("--autoscale-max", type=int, default=None, help="... and this many (give both).")
    g.add_argument("--autoscale-target-waiting", type=int, default=DEFAULT_TARGET_WAITING,
                   help="Waiting requests per replica the autoscaler aims at, beyond max_num_seqs running ones.")
    g.add_argument("--ray-cpus-per-replica", type=float, default=1.0, help="Ray CPUs each engine replica takes.")
    g.add_argument("--ray-gpus-per-replica", type=float, default=0.0, help="Ray GPUs each engine replica takes.")
    g.add_argument("--router", choices=ROUTER_POLICIES, default=RouterConfig.policy,
                   help="How requests pick a replica: prefix (the one holding the longest cached run of the "
                        "request's blocks, unless overloaded), least-loaded (power of two choices) or "
                        "round-robin.")
    g.add_argument("--router-imbalance-threshold", type=int, default=RouterConfig.imbalance_threshold,
                   help="With --router prefix: requests in flight by which the prefix's replica may exceed the "
                        "least-loaded one before a request goes to the least-loaded instead.")


def _run_serve(args: argparse.Namespace) -> int:
    from pagedserve.distributed.config import check_ray_flags_need_ray

    check_ray_flags_need_ray(args, build_parser("serve").parse_args(["serve"]))
    if args.ray:
        from pagedserve.distributed.launcher import serve_on_ray

        return serve_on_ray(args)
    from pagedserve.entrypoints.openai.server import serve

    return serve(args)


def _add_keys(subparsers) -> None:
    p = subparsers.add_parser("keys", help="Manage the API keys file of `pagedserve serve --api-keys-file`.")
    actions = p.add_subparsers(dest="keys_action", required=True)
    add = actions.add_parser("add", help="Make a new random key for a new tenant: the key is printed once on "
                             "stdout, the file keeps only its SHA-256.")
    add.add_argument("name", help="The tenant's name (1-64 of A-Z a-z 0-9 . _ -), as it appears in logs and "
                     "metrics.")
    add.add_argument("--file", default="keys.toml", help="The keys file (created when missing; JSON when the name "
                     "ends in .json). Default: keys.toml.")
    add.add_argument("--scope", choices=("user", "admin"), default="user",
                     help="admin keys may use the admin routes and ask for any priority. Default: user.")
    add.add_argument("--priority", type=int, default=0,
                     help="Default priority of its requests (lower runs first). Default: 0.")
    add.add_argument("--min-priority", type=int, default=None,
                     help="The best (lowest) priority a user key may ask for. Default: --priority.")
    for flag, what in (("--requests-per-minute", "requests"), ("--tokens-per-minute", "tokens (prompt + "
                       "max_tokens * n, the unused part refunded)"), ("--max-concurrent-requests", None)):
        add.add_argument(flag, type=int, default=None,
                         help=f"Limit on {what} per minute. Default: unlimited." if what else
                         "Limit on requests in flight at once. Default: unlimited.")
    add.set_defaults(func=_run_keys_add)


def _run_keys_add(args: argparse.Namespace) -> int:
    from pagedserve.tenants.keys_file import add_tenant
    from pagedserve.tenants.tenant import Tenant, hash_key, new_key

    key = new_key()
    fields = {"key_sha256": hash_key(key), "scope": args.scope, "priority": args.priority}
    for name in ("min_priority", "requests_per_minute", "tokens_per_minute", "max_concurrent_requests"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    add_tenant(args.file, Tenant.from_fields(args.name, fields))
    print(key)
    print(f"added tenant {args.name!r} ({args.scope}) to {args.file}; the key above is shown only this once "
          "(the file keeps its SHA-256); send SIGHUP to a running server to load it", file=sys.stderr)
    return 0


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
    k = kinds.add_parser("soak", help="Drive a server past its capacity with a hostile mix (disconnects, "
                         "malformed bodies, n > 1, streams, greedy probes) and check that no request is lost, mixed "
                         "up or leaked; exit 1 on any violation.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from pagedserve.benchmarks.soak import cli as soak

    soak.add_cli_args(k)
    k.set_defaults(func=soak.cli_main)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line; with `command` (one of its commands) only that command's parser: the benchmarks' import
    torch (~1 s), which `pagedserve serve` would otherwise pay before it starts the engine process, and `pagedserve
    keys` would pay at all."""
    parser = argparse.ArgumentParser(prog="pagedserve", description="High-throughput LLM inference engine.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    commands = {"generate": _add_generate, "serve": _add_serve, "keys": _add_keys, "bench": _add_bench}
    for name, add in commands.items():
        if command not in commands or name == command:
            add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagedserve.logging_utils import LoggingConfig, configure_logging

    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["serve"]:
            argv = expand_config_file(_serve_parser(), argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    if getattr(args, "config", None) is not None:  # expand_config_file took the one it knows
        print("error: give --config once, spelled out in full", file=sys.stderr)
        return 2
    configure_logging(LoggingConfig(getattr(args, "log_level", "info"), getattr(args, "log_format", "text")))
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
