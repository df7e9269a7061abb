"""Serving benchmark: `pagedserve bench serve` loads any OpenAI-compatible server and measures it.

Flag names and result keys follow `vllm bench serve`, so existing scripts keep working. Every request is
streamed (`stream: true`, `stream_options.include_usage`) over aiohttp; see serve_metrics for what is
measured and how, serve_datasets for the prompts, serve_report for the printed report, JSON and charts.

Load: requests are sent in dataset order; the gaps between sends are drawn from a gamma distribution with
shape `--burstiness` and mean 1 / `--request-rate` (burstiness 1 = Poisson; `--request-rate inf` sends all at
once), seeded by `--seed`; `--max-concurrency` caps how many are in flight (a request waiting for a slot is
not in flight, and its latency starts when it is sent). `--num-warmups` requests go first, untimed.
Each send is scheduled at its absolute time since the start (the sum of the gaps before it), so that a late
wake-up does not push every later send back.

Multi-tenant load (`--tenants SPEC [SPEC ...]`, see serve_tenants): each tenant has its own API key, request
mix and arrival process, all running at once against the server; the report adds a per-tenant table and the
JSON a `tenants` object, beside the overall numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional

import numpy as np

from pagedserve.benchmarks import serve_datasets, serve_metrics, serve_report, serve_tenants
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
    g.add_argument("--api-key", default=None,
                   help="sent as `Authorization: Bearer KEY` (default: env OPENAI_API_KEY, as vLLM's bench; a "
                        "--tenants spec's own key wins for its requests)")
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
    lo.add_argument("--tenants", nargs="+", type=serve_tenants.parse_tenant_spec, default=None, metavar="SPEC",
                    help="multi-tenant load: one SPEC per tenant, comma-separated KEY=VALUE with name (required), "
                         "api_key or api_key_env, num_prompts, request_rate, burstiness, max_concurrency, "
                         "random_input_len, random_output_len (default: the global flags), arrivals "
                         "(poisson|uniform), priority; e.g. name=flood,api_key=K1,num_prompts=200 "
                         "name=chat,api_key=K2,num_prompts=15,request_rate=0.5,arrivals=uniform,priority=0")
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


async def send_request(session, url: str, payload: dict, prompt_len: Optional[int], tokenizer,
                       headers: Optional[dict] = None) -> RequestResult:
    """One streamed request (with extra HTTP `headers`, e.g. a tenant's Authorization); errors end up in the
    result, never raised."""
    import aiohttp

    r = RequestResult(prompt_len=prompt_len or 0)
    chunks = 0
    first_choice = None
    start = time.perf_counter()
    r.start_time = start
    last = start
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
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


async def _get(session, url: str, headers: Optional[dict] = None) -> tuple[int, str]:
    async with session.get(url, headers=headers) as resp:
        return resp.status, await resp.text()


async def read_server_metrics(session, url: str, headers: Optional[dict] = None) -> Optional[dict]:
    """The server's counters from /metrics, or None when it has no Prometheus page."""
    import aiohttp

    try:
        status, text = await _get(session, f"{url}/metrics", headers)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None
    if status != 200:
        return None
    try:
        found = serve_metrics.parse_server_metrics(text)
    except ValueError:
        return None
    return found or None


async def resolve_model(session, url: str, model: Optional[str], headers: Optional[dict] = None) -> str:
    """Check that the server answers; pick the first served model when none is given."""
    import aiohttp

    try:
        status, text = await _get(session, f"{url}/v1/models", headers)
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


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int, arrivals: str = "poisson") -> list[float]:
    """Seconds to wait before each request, after the previous one; zeros for rate inf.

    poisson: gamma(shape=burstiness, mean=1/rate), seeded (burstiness 1 is a Poisson process); uniform: the
    first at once, then exactly 1/rate apart (burstiness and seed do not matter)."""
    if rate == float("inf"):
        return [0.0] * n
    if arrivals == "uniform":
        return [0.0 if i == 0 else 1.0 / rate for i in range(n)]
    theta = 1.0 / (rate * burstiness)
    return np.random.default_rng(seed).gamma(burstiness, theta, size=n).tolist()


@dataclass
class Lane:
    """One arrival process: the whole run without --tenants, one per tenant with it."""

    requests: list[SampleRequest]
    gaps: list[float]  # from arrival_gaps
    max_concurrency: Optional[int] = None  # in flight at once, for this lane alone
    headers: Optional[dict] = None  # sent with every request, e.g. the tenant's Authorization
    body_fields: dict = field(default_factory=dict)  # added to every request body, e.g. priority


class _LaneSender:
    """Sends one lane's requests on a shared session, on its own schedule and under its own cap."""

    def __init__(self, session, target: str, lane: Lane, payloads: list[dict], tokenizer) -> None:
        self.session, self.target, self.lane, self.payloads, self.tokenizer = session, target, lane, payloads, tokenizer
        self.semaphore = asyncio.Semaphore(lane.max_concurrency) if lane.max_concurrency else None

    async def send(self, i: int) -> RequestResult:
        """Request i, once a slot is free (its latency starts when it is sent, not while it waits)."""
        req = self.lane.requests[i]
        if self.semaphore is None:
            return await send_request(self.session, self.target, self.payloads[i], req.prompt_len, self.tokenizer,
                                      self.lane.headers)
        async with self.semaphore:
            return await send_request(self.session, self.target, self.payloads[i], req.prompt_len, self.tokenizer,
                                      self.lane.headers)

    async def run(self, start: float, bar) -> tuple[list[RequestResult], float]:
        """Every request at start + the sum of the gaps before it; the results and the time the last one ended."""

        async def tracked(i: int) -> RequestResult:
            result = await self.send(i)
            if bar is not None:
                bar.update(1)
            return result

        tasks, due = [], start
        for i, gap in enumerate(self.lane.gaps):
            due += gap
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(tracked(i)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter()


async def _warm_up(senders: list[_LaneSender], count: int) -> None:
    """`count` untimed requests, round-robin over the lanes and over each lane's requests."""
    picks = [(senders[k % len(senders)], k // len(senders)) for k in range(count)]
    warm = await asyncio.gather(*(s.send(i % len(s.lane.requests)) for s, i in picks))
    failed = [w for w in warm if not w.success]
    if len(failed) == len(warm):
        raise BenchmarkError(f"every warm-up request failed; the first: {failed[0].error}")


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", file=sys.stderr)


async def run_lanes(args, url: str, endpoint: str, model: Optional[str], lanes: list[Lane], tokenizer,
                    progress: bool = True) -> dict:
    """Run every lane at once from one t=0. "results" holds all results (lane after lane), "lanes" each
    lane's results and duration (from t=0 to the end of its last request)."""
    import aiohttp

    # A server with API keys wants one on /v1/models and /metrics too: --api-key's, else the first lane's.
    admin = global_headers(args) or next((lane.headers for lane in lanes if lane.headers), None)
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=False) as session:
        model = await resolve_model(session, url, model, admin)
        senders = [_LaneSender(session, url + endpoint, lane,
                               [{**build_payload(endpoint, model, req, args), **lane.body_fields}
                                for req in lane.requests], tokenizer) for lane in lanes]
        if args.num_warmups:
            await _warm_up(senders, args.num_warmups)
        before = None if args.no_server_metrics else await read_server_metrics(session, url, admin)
        bar = _progress_bar(sum(len(lane.requests) for lane in lanes), progress and not args.disable_tqdm)
        start = time.perf_counter()
        finished = await asyncio.gather(*(s.run(start, bar) for s in senders))
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
        after = None if args.no_server_metrics else await read_server_metrics(session, url, admin)
    return {"results": [r for results, _ in finished for r in results], "duration": duration, "start": start,
            "lanes": [{"results": results, "duration": end - start} for results, end in finished],
            "model": model, "server_before": before, "server_after": after}


async def run_load(args, url: str, endpoint: str, model: Optional[str], requests: list[SampleRequest], tokenizer,
                   progress: bool = True) -> dict:
    """The run without --tenants: one lane with the global --request-rate, --burstiness and --max-concurrency."""
    gaps = arrival_gaps(len(requests), args.request_rate, args.burstiness, args.seed)
    return await run_lanes(args, url, endpoint, model, [Lane(requests, gaps, args.max_concurrency,
                                                             global_headers(args))], tokenizer, progress)


def global_headers(args) -> Optional[dict]:
    """--api-key (or env OPENAI_API_KEY) as an Authorization header; None without one."""
    return serve_tenants.bearer(getattr(args, "api_key", None) or os.environ.get("OPENAI_API_KEY"))


def tenant_lanes(args, tokenizer) -> list[Lane]:
    """One lane per --tenants spec: its own requests, gaps, cap, key and body fields."""
    lanes = []
    for i, spec in enumerate(args.tenants):
        own = serve_tenants.tenant_args(args, spec, i)
        requests = serve_datasets.build_requests(own, tokenizer)
        gaps = arrival_gaps(len(requests), own.request_rate, own.burstiness, own.seed, spec.arrivals)
        lanes.append(Lane(requests, gaps, own.max_concurrency,
                          serve_tenants.auth_headers(spec) or global_headers(args), serve_tenants.body_fields(spec)))
    return lanes


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
    serve_tenants.check_unique_names(args.tenants or [])


def _run(args, url: str, endpoint: str) -> dict:
    """Build the requests (per tenant with --tenants) and load the server with them."""
    tokenizer = serve_datasets.load_tokenizer(args.tokenizer) if serve_datasets.needs_tokenizer(args) else None
    model = args.model or args.served_model_name
    if args.tenants:
        return asyncio.run(run_lanes(args, url, endpoint, model, tenant_lanes(args, tokenizer), tokenizer))
    requests = serve_datasets.build_requests(args, tokenizer)
    return asyncio.run(run_load(args, url, endpoint, model, requests, tokenizer))


def _load_keys(args, run: dict) -> dict:
    """num_prompts, request_rate, burstiness, max_concurrency: the global flags, or "per-tenant" with --tenants
    (each tenant's own are in its `tenants` entry)."""
    if args.tenants:
        return {"num_prompts": len(run["results"]), "request_rate": "per-tenant", "burstiness": "per-tenant",
                "max_concurrency": "per-tenant"}
    return {"num_prompts": args.num_prompts,
            "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency}


def _build_result(args, url: str, endpoint: str, run: dict, percentiles: list[float], slos: dict) -> dict:
    """The result dict: the run's settings, vLLM's metric keys and the per-request lists."""
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
        **_load_keys(args, run),
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
    if args.tenants:
        result["tenants"] = _tenant_results(args, run, percentiles, slos)
        # which tenant sent each request of the lists above (they hold the tenants one after the other)
        result["request_tenants"] = [spec.name for spec, lane in zip(args.tenants, run["lanes"])
                                     for _ in lane["results"]]
    if args.save_detailed:
        result["generated_texts"] = [r.generated_text for r in results]
    return result


def _tenant_results(args, run: dict, percentiles: list[float], slos: dict) -> dict:
    """{tenant name: its load and its metrics}, each tenant's throughput over its own duration."""
    out = {}
    for i, (spec, lane) in enumerate(zip(args.tenants, run["lanes"])):
        metrics = serve_metrics.compute_metrics(lane["results"], lane["duration"], percentiles, slos, run["start"])
        out[spec.name] = serve_tenants.tenant_entry(spec, serve_tenants.tenant_args(args, spec, i), metrics)
    return out


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
    url = base_url(args)
    run = _run(args, url, endpoint)
    result = _build_result(args, url, endpoint, run, percentiles, slos)
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
        written = serve_report.plot(result, run["results"], run["start"], args.plot)
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
