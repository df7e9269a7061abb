"""Serving benchmark: `pagedserve bench serve` loads any OpenAI-compatible server and measures it.

Flag names and result keys follow `vllm bench serve`, so existing scripts keep working. Every request is
streamed (`stream: true`, `stream_options.include_usage`) over aiohttp; see serve_metrics for what is
measured and how, serve_datasets for the prompts, serve_report for the printed report, JSON and charts.

Load: requests are sent in dataset order; the gaps between sends are drawn from a gamma distribution with
shape `--burstiness` and mean 1 / `--request-rate` (burstiness 1 = Poisson; `--request-rate inf` sends all at
once), seeded by `--seed`; `--max-concurrency` caps how many are in flight (a request waiting for a slot is
not in flight, and its latency starts when it is sent). `--num-warmups` requests go first, untimed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from datetime import datetime
from typing import Optional

import numpy as np

from pagedserve.benchmarks import serve_datasets, serve_metrics, serve_report
from pagedserve.benchmarks.serve_datasets import SampleRequest
from pagedserve.benchmarks.serve_metrics import RequestResult

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
HTTP_TIMEOUT_S = 6 * 3600


class BenchmarkError(Exception):
    """A failure to report as one clear line (unreachable server, no request succeeded...)."""


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `pagedserve bench serve` (vLLM's names)."""
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (else --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=None, choices=ENDPOINTS,
                   help="API path (default /v1/completions; /v1/chat/completions with --backend openai-chat)")
    g.add_argument("--backend", default="openai", choices=["openai", "openai-chat", "vllm", "pagedserve"],
                   help="request format: completions (openai, vllm, pagedserve) or chat (openai-chat)")
    g.add_argument("--model", default=None, help="model name sent to the server (default: the first of /v1/models)")
    g.add_argument("--served-model-name", default=None, help="alias of --model, as in vLLM")
    g.add_argument("--tokenizer", default=None,
                   help="HF folder or GGUF file whose tokenizer builds and counts prompts (default: pagedserve's "
                        "default model, loaded only when the dataset needs one)")
    d = parser.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "prefix", "jsonl"])
    d.add_argument("--dataset-path", default=None, help="local file for sharegpt and jsonl")
    d.add_argument("--num-prompts", type=int, default=1000, help="number of requests")
    d.add_argument("--prompt-format", default="text", choices=["text", "token-ids"],
                   help="random and prefix prompts as text, or as token ids (/v1/completions only)")
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)]")
    d.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="output length of every sharegpt request (default: the reply's length)")
    d.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    d.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    d.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    d.add_argument("--prefix-repetition-output-len", type=int, default=128)
    d.add_argument("--jsonl-output-len", "--custom-output-len", dest="jsonl_output_len", type=int, default=128,
                   help="max tokens of jsonl prompts that do not give their own")
    lo = parser.add_argument_group("load")
    lo.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests per second (inf: all at once)")
    lo.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the gaps between requests (1 = Poisson; < 1 burstier, > 1 steadier)")
    lo.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    lo.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly max_tokens")
    lo.add_argument("--temperature", type=float, default=0.0)
    lo.add_argument("--seed", type=int, default=0)
    lo.add_argument("--num-warmups", type=int, default=0, help="untimed requests sent before the run")
    r = parser.add_argument_group("report")
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics to report percentiles of (ttft, tpot, itl, e2el)")
    r.add_argument("--metric-percentiles", default="90,99", help="percentiles to report, besides mean and median")
    r.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="objectives, e.g. ttft:500 tpot:50 e2el:5000; goodput = requests/s meeting all of them")
    r.add_argument("--save-result", action="store_true", help="write the result JSON")
    r.add_argument("--save-detailed", action="store_true", help="also keep generated_texts in the JSON")
    r.add_argument("--result-dir", default=None)
    r.add_argument("--result-filename", default=None)
    r.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="extra keys for the JSON")
    r.add_argument("--label", default=None)
    r.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts into DIR")
    r.add_argument("--disable-tqdm", action="store_true")
    r.add_argument("--no-server-metrics", action="store_true", help="do not read the server's /metrics")
    return parser


# ---------------------------------------------------------------------------------------------------------
# HTTP


def base_url(args) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def build_payload(endpoint: str, model: str, req: SampleRequest, args) -> dict:
    payload: dict = {"model": model, "temperature": args.temperature, "stream": True,
                     "stream_options": {"include_usage": True}}
    if endpoint == "/v1/chat/completions":
        if not isinstance(req.prompt, str):
            raise ValueError("token-id prompts need --endpoint /v1/completions")
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.expected_output_len
    else:
        payload["prompt"] = req.prompt
        payload["max_tokens"] = req.expected_output_len
    if args.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _chunk_text(data: dict) -> str:
    text = ""
    for choice in data.get("choices") or []:
        if "text" in choice:
            text += choice.get("text") or ""
        else:
            delta = choice.get("delta") or {}
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return text


async def send_request(session, url: str, payload: dict, prompt_len: Optional[int], tokenizer) -> RequestResult:
    """One streamed request; errors end up in the result, never raised."""
    import aiohttp

    r = RequestResult(prompt_len=prompt_len or 0)
    chunks = 0
    first_choice = None
    start = time.perf_counter()
    r.start_time = start
    last = start
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300].strip()
                r.error = f"HTTP {resp.status}: {body}"
                return r
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data_s = line[5:].strip()
                if data_s == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(data_s)
                if "error" in data and not data.get("choices"):
                    err = data["error"]
                    r.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return r
                if data.get("choices") and first_choice is None:
                    first_choice = now
                text = _chunk_text(data)
                if text:
                    if chunks == 0:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last = now
                    chunks += 1
                    r.chunk_times.append(now)
                    r.generated_text += text
                if data.get("usage"):
                    r.usage = data["usage"]
        r.latency = time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"[:300]
        r.latency = time.perf_counter() - start
        return r
    usage = r.usage or {}
    if chunks == 0:
        # Generated tokens may decode to no text (special tokens, held-back partial characters): time the
        # first chunk instead; without usage there is no telling that anything was generated.
        if first_choice is None or not usage.get("completion_tokens"):
            r.error = "the stream ended without any generated text"
            return r
        r.ttft = first_choice - start
    if usage.get("completion_tokens") is not None:
        r.output_tokens = int(usage["completion_tokens"])
    elif tokenizer is not None:
        r.output_tokens = len(tokenizer.encode(r.generated_text, add_special_tokens=False))
    else:
        r.output_tokens = chunks
    if prompt_len is None and usage.get("prompt_tokens") is not None:
        r.prompt_len = int(usage["prompt_tokens"])
    r.success = True
    return r


async def _get(session, url: str) -> tuple[int, str]:
    async with session.get(url) as resp:
        return resp.status, await resp.text()


async def read_server_metrics(session, url: str) -> Optional[dict]:
    """The server's counters from /metrics, or None when it has no Prometheus page."""
    import aiohttp

    try:
        status, text = await _get(session, f"{url}/metrics")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None
    if status != 200:
        return None
    try:
        found = serve_metrics.parse_server_metrics(text)
    except ValueError:
        return None
    return found or None


async def resolve_model(session, url: str, model: Optional[str]) -> str:
    """Check that the server answers; pick the first served model when none is given."""
    import aiohttp

    try:
        status, text = await _get(session, f"{url}/v1/models")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise BenchmarkError(f"cannot reach the server at {url}: {e}") from None
    if model:
        return model
    if status != 200:
        raise BenchmarkError(f"GET {url}/v1/models answered HTTP {status}; pass --model")
    try:
        return json.loads(text)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchmarkError(f"GET {url}/v1/models did not list a model; pass --model") from None


# ---------------------------------------------------------------------------------------------------------
# Load


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: gamma(shape=burstiness, mean=1/rate); zeros for rate inf."""
    if rate == float("inf"):
        return [0.0] * n
    theta = 1.0 / (rate * burstiness)
    return np.random.default_rng(seed).gamma(burstiness, theta, size=n).tolist()


async def run_load(args, url: str, endpoint: str, model: str, requests: list[SampleRequest], tokenizer,
                   progress: bool = True) -> dict:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=False) as session:
        model = await resolve_model(session, url, model)
        payloads = [build_payload(endpoint, model, req, args) for req in requests]
        target = url + endpoint
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(payload, req):
            if semaphore is None:
                return await send_request(session, target, payload, req.prompt_len, tokenizer)
            async with semaphore:
                return await send_request(session, target, payload, req.prompt_len, tokenizer)

        if args.num_warmups:
            warm = [limited(payloads[i % len(payloads)], requests[i % len(requests)]) for i in range(args.num_warmups)]
            warm_results = await asyncio.gather(*warm)
            warm_failed = [w for w in warm_results if not w.success]
            if len(warm_failed) == len(warm_results):
                raise BenchmarkError(f"every warm-up request failed; the first: {warm_failed[0].error}")

        before = None if args.no_server_metrics else await read_server_metrics(session, url)
        bar = None
        if progress and not args.disable_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="requests", file=sys.stderr)
        gaps = arrival_gaps(len(requests), args.request_rate, args.burstiness, args.seed)
        tasks = []
        start = time.perf_counter()

        async def tracked(payload, req):
            result = await limited(payload, req)
            if bar is not None:
                bar.update(1)
            return result

        for i, (payload, req) in enumerate(zip(payloads, requests)):
            if gaps[i] > 0:
                await asyncio.sleep(gaps[i])
            tasks.append(asyncio.create_task(tracked(payload, req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
        after = None if args.no_server_metrics else await read_server_metrics(session, url)
    return {"results": results, "duration": duration, "start": start, "model": model,
            "server_before": before, "server_after": after}


# ---------------------------------------------------------------------------------------------------------
# Entry points


def _validate(args) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf for all at once), got {args.request_rate}")
    if args.burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    unknown = set(args.percentile_metrics.split(",")) - set(serve_metrics.METRICS)
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}; known: {', '.join(serve_metrics.METRICS)}")


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark described by `args`; print the report and return the result dict (vLLM's keys)."""
    _validate(args)
    slos = serve_metrics.parse_goodput(args.goodput)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions")
    if args.prompt_format == "token-ids" and endpoint != "/v1/completions":
        raise ValueError("--prompt-format token-ids needs --endpoint /v1/completions")
    if args.plot:
        serve_report.check_plotting()
    tokenizer = serve_datasets.load_tokenizer(args.tokenizer) if serve_datasets.needs_tokenizer(args) else None
    requests = serve_datasets.build_requests(args, tokenizer)
    url = base_url(args)
    run = asyncio.run(run_load(args, url, endpoint, args.model or args.served_model_name, requests, tokenizer))
    results: list[RequestResult] = run["results"]

    metrics = serve_metrics.compute_metrics(results, run["duration"], percentiles, slos, run["start"])
    result: dict = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "label": args.label,
        "base_url": url,
        "endpoint": endpoint,
        "model_id": run["model"],
        "tokenizer_id": args.tokenizer,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "num_warmups": args.num_warmups,
        "goodput_slos_ms": slos or None,
        **metrics,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.latency for r in results],
        "start_times": [r.start_time - run["start"] for r in results],
        "errors": [r.error for r in results],
        "server_metrics": serve_metrics.server_view(run["server_before"], run["server_after"]),
    }
    if args.save_detailed:
        result["generated_texts"] = [r.generated_text for r in results]
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item!r}: expected KEY=VALUE")
        result[key] = value

    serve_report.print_report(result, args.percentile_metrics.split(","), percentiles)
    if args.save_result or args.result_filename:
        path = serve_report.save_result(result, args)
        print(f"result written to {path}")
    if args.plot:
        written = serve_report.plot(result, results, run["start"], args.plot)
        print(f"charts written to {args.plot}: {', '.join(written)}")
    return result


def cli_main(args: argparse.Namespace) -> int:
    """`pagedserve bench serve`: 0 when every request succeeded, 1 when some failed or the run could not start."""
    try:
        result = main(args)
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result["completed"] == 0:
        print("error: no request succeeded", file=sys.stderr)
        return 1
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    _parser = add_cli_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    sys.exit(cli_main(_parser.parse_args()))
