"""Run pagedserve's throughput workload W1 against llama.cpp's own HTTP server (`llama-server`).

Runs in pagedserve's environment (aiohttp when installed; otherwise threads and urllib).

W1: ``--num-prompts`` (256) requests of ``--input-len`` (128) random prompt token ids made by pagedserve's own
``pagedserve.benchmarks.throughput.make_prompts`` (seed 0), each generating exactly ``--output-len`` (128)
tokens: greedy (temperature 0), ignore_eos, no prompt caching.
The vocabulary size comes from the server's /v1/models (``meta.n_vocab``).

What the script does:

1. starts ``llama-server`` as a subprocess (``--model``, ``--parallel N`` slots, ``--ctx-size N * ctx_per_slot``
   so that each slot holds exactly input_len + output_len tokens, ``--threads``/``--threads-batch``,
   continuous batching, a free port) and waits for GET /health to answer 200 (= ``startup_s``, model loading
   and llama-server's own warm-up included);
2. a small untimed warm-up (2 requests x 4 tokens, like pagedserve's benchmark);
3. W1: every request is POSTed to /completion at once (``"prompt"`` = the list of token ids, ``n_predict``,
   ``temperature 0``, ``ignore_eos``, ``cache_prompt false``); timed from the first submit to the last
   response;
4. stops the server (SIGTERM, then SIGKILL after a grace period), also on errors and Ctrl-C;
5. prints one JSON line: engine, model_file, requests, output_tokens (sum of the responses'
   ``tokens_predicted``), elapsed_s, output_tok_per_s, startup_s, and some context (exact: whether every
   request produced exactly output_len tokens).

Examples::

    python benchmarks/engines/llamacpp_w1.py                       # full W1 (256 x 128 -> 128), default model
    python benchmarks/engines/llamacpp_w1.py --num-prompts 8 --output-len 16 --parallel 8   # smoke test
    python benchmarks/engines/llamacpp_w1.py --model /work/engines/smollm2-bf16.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from pagedserve.benchmarks.throughput import WARMUP_PROMPTS, WARMUP_TOKENS, make_prompts
from pagedserve.loader.model_loader import default_model_path

DEFAULT_SERVER_BIN = "/work/engines/llama.cpp-build/bin/llama-server"


# ---------------------------------------------------------------------------------------------------------
# server process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, payload: dict | None = None, timeout: float = 10.0) -> tuple[int, dict]:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body or b"{}")
        except ValueError:
            return e.code, {"raw": body.decode(errors="replace")}


class Server:
    def __init__(self, args: argparse.Namespace, log_path: str) -> None:
        self.args = args
        self.log_path = log_path
        self.port = args.port or free_port()
        self.url = f"http://{args.host}:{self.port}"
        self.ctx_size = args.parallel * args.ctx_per_slot
        self.cmd = [
            args.server_bin,
            "--model", args.model,
            "--host", args.host,
            "--port", str(self.port),
            "--parallel", str(args.parallel),
            "--ctx-size", str(self.ctx_size),
            "--threads", str(args.threads),
            "--threads-batch", str(args.threads_batch or args.threads),
            "--cont-batching",
            "--kv-unified" if args.kv_unified else "--no-kv-unified",
            "--cache-ram", "0",   # W1 never reuses a prompt: no host-memory prompt cache
            "--no-webui",
        ]
        if args.batch_size:
            self.cmd += ["--batch-size", str(args.batch_size)]
        if args.ubatch_size:
            self.cmd += ["--ubatch-size", str(args.ubatch_size)]
        self.cmd += shlex.split(args.server_args or "")
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def start(self) -> None:
        print("server:", shlex.join(self.cmd), file=sys.stderr, flush=True)
        log = open(self.log_path, "w")
        start = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + self.args.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} during start-up; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                status, _ = http_json(self.url + "/health", timeout=2.0)
                if status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not healthy after {self.args.startup_timeout}s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.05)
        self.startup_s = time.perf_counter() - start

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=self.args.stop_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


# ---------------------------------------------------------------------------------------------------------
# requests


def completion_payload(prompt: list[int], n_predict: int) -> dict:
    return {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_prompt": False,
        "stream": False,
        "return_tokens": True,
        "response_fields": ["tokens_predicted", "tokens_evaluated", "tokens", "truncated", "stop_type",
                            "timings"],
    }


def send_all_threads(url: str, payloads: list[dict], timeout: float) -> list[dict]:
    def one(p: dict) -> dict:
        status, body = http_json(url + "/completion", p, timeout=timeout)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body}")
        return body

    with ThreadPoolExecutor(max_workers=max(1, len(payloads))) as pool:
        return list(pool.map(one, payloads))


async def _send_all_aiohttp(url: str, payloads: list[dict], timeout: float) -> list[dict]:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async def one(p: dict) -> dict:
            async with session.post(url + "/completion", json=p) as resp:
                body = await resp.json(content_type=None)
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {body}")
                return body

        return list(await asyncio.gather(*(one(p) for p in payloads)))


def have_aiohttp() -> bool:
    return importlib.util.find_spec("aiohttp") is not None


def send_all(url: str, payloads: list[dict], timeout: float, client: str) -> list[dict]:
    if client == "aiohttp":
        return asyncio.run(_send_all_aiohttp(url, payloads, timeout))
    return send_all_threads(url, payloads, timeout)


# ---------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server-bin", default=os.environ.get("LLAMA_SERVER_BIN", DEFAULT_SERVER_BIN),
                   help=f"llama-server binary (default: $LLAMA_SERVER_BIN or {DEFAULT_SERVER_BIN})")
    p.add_argument("--model", default=None, help="GGUF file (default: pagedserve's default model, the Q4_1 GGUF)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    p.add_argument("--parallel", type=int, default=None, help="llama-server slots (default: --num-prompts)")
    p.add_argument("--ctx-per-slot", type=int, default=None,
                   help="context tokens per slot; --ctx-size = parallel * this (default: input + output len)")
    p.add_argument("--threads", type=int, default=2, help="llama-server --threads")
    p.add_argument("--threads-batch", type=int, default=None, help="llama-server --threads-batch (default: --threads)")
    p.add_argument("--batch-size", type=int, default=None, help="llama-server --batch-size (default: its own)")
    p.add_argument("--ubatch-size", type=int, default=None, help="llama-server --ubatch-size (default: its own)")
    p.add_argument("--kv-unified", action="store_true",
                   help="one KV buffer shared by all slots (llama-server's default only when -np is auto)")
    p.add_argument("--server-args", default="", help="extra llama-server arguments (one shell-quoted string)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--client", default="auto", choices=["auto", "aiohttp", "threads"])
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help=f"untimed {WARMUP_PROMPTS} requests x {WARMUP_TOKENS} tokens before W1")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=7200.0)
    p.add_argument("--stop-timeout", type=float, default=30.0)
    p.add_argument("--server-log", default=None, help="llama-server stdout/stderr (default: a temporary file)")
    p.add_argument("--output-json", default=None, help="also write the result JSON to this file")
    p.add_argument("--output-tokens", default=None,
                   help="write the generated token ids (one JSON list per request, in prompt order) here")
    args = p.parse_args(argv)
    args.model = os.path.abspath(args.model or default_model_path())
    if args.parallel is None:
        args.parallel = args.num_prompts
    if args.ctx_per_slot is None:
        args.ctx_per_slot = args.input_len + args.output_len
    if args.client == "auto":
        args.client = "aiohttp" if have_aiohttp() else "threads"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    for path, what in ((args.server_bin, "--server-bin"), (args.model, "--model")):
        if not os.path.isfile(path):
            raise SystemExit(f"{what}: no such file: {path}")
    load_before = os.getloadavg()[0]  # a busy machine ruins llama.cpp's spin-waiting threads: check this
    log_path = args.server_log or tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1]
    server = Server(args, log_path)

    def on_sigterm(signum, frame):  # turn SIGTERM into an exception so that `finally` stops the server
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        server.start()
        _, models = http_json(server.url + "/v1/models")
        meta = (models.get("data") or [{}])[0].get("meta", {})
        vocab_size = int(meta.get("n_vocab", 0))
        if vocab_size <= 0:
            raise RuntimeError(f"no n_vocab in /v1/models: {models}")
        _, props = http_json(server.url + "/props")

        if args.warmup:
            warm = make_prompts(WARMUP_PROMPTS, min(args.input_len, 8), vocab_size, args.seed + 1)
            send_all(server.url, [completion_payload(p, WARMUP_TOKENS) for p in warm], args.request_timeout,
                     args.client)

        prompts = make_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
        payloads = [completion_payload(p, args.output_len) for p in prompts]
        start = time.perf_counter()
        results = send_all(server.url, payloads, args.request_timeout, args.client)
        elapsed = time.perf_counter() - start
    except BaseException:
        print(f"--- llama-server log tail ({log_path}) ---\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()

    predicted = [int(r.get("tokens_predicted", 0)) for r in results]
    evaluated = [int(r.get("tokens_evaluated", 0)) for r in results]
    output_tokens = sum(predicted)
    out = {
        "engine": "llama.cpp llama-server",
        "model_file": args.model,
        "requests": len(results),
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 4),
        "output_tok_per_s": round(output_tokens / elapsed, 2),
        "startup_s": round(server.startup_s, 3),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "exact": all(n == args.output_len for n in predicted) and all(n == args.input_len for n in evaluated),
        "min_tokens_predicted": min(predicted, default=0),
        # llama-server flags a request "truncated" when its slot's context is full after the last token; with
        # ctx_per_slot = input + output this happens on the final token and the output is still complete
        # (see "exact"), so this is informational.
        "hit_ctx_limit": sum(bool(r.get("truncated")) for r in results),
        "parallel": args.parallel,
        "ctx_size": server.ctx_size,
        "threads": args.threads,
        "vocab_size": vocab_size,
        "client": args.client,
        "loadavg_1m_before": round(load_before, 2),
        "server_build": props.get("build_info"),
        "server_cmd": shlex.join(server.cmd),
    }
    line = json.dumps(out)
    print(line, flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(line + "\n")
    if args.output_tokens:
        with open(args.output_tokens, "w") as f:
            for r in results:
                f.write(json.dumps(r.get("tokens", [])) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
