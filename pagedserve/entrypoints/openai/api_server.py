"""The FastAPI app: routes, OpenAI-shaped errors, and the gate (gate.py: request ids, API keys and tenants,
admin routes, body-size limit, rate limits, HTTP metrics, the access log).

`build_app(async_llm, args)` takes the AsyncLLM (already running) and the parsed `pagedserve serve` args; it
does not own the engine: whoever built the AsyncLLM shuts it down. `app.state.reload_keys()` re-reads the keys
file (what SIGHUP does, see server.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, Optional

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

import pagedserve
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.allowed_paths import resolved_dirs
from pagedserve.entrypoints.openai.errors import OpenAIError, error_response, from_validation_error
from pagedserve.entrypoints.openai.gate import ADMIN_ROUTES, OPEN_ROUTES, ROUTES, Gate  # noqa: F401 - re-exported
from pagedserve.entrypoints.openai.lora_modules import LoRAModules
from pagedserve.entrypoints.openai.openapi import install_openapi
from pagedserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                    InjectFaultRequest, LoadLoRAAdapterRequest, TokenizeRequest,
                                                    UnloadLoRAAdapterRequest)
from pagedserve.entrypoints.openai.serving_base import ClientDisconnected, ServerConfig
from pagedserve.entrypoints.openai.serving_chat import ServingChat
from pagedserve.entrypoints.openai.serving_completion import ServingCompletion
from pagedserve.logging_utils.request_log import RequestLog, RequestLogConfig
from pagedserve.metrics.prometheus import CONTENT_TYPE, DEFAULT_MAX_METRIC_TENANTS, PrometheusStatLogger
from pagedserve.tenants.rate_limiter import RateLimiter
from pagedserve.tenants.registry import TenantRegistry, TenantStore

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 << 20


def default_model_name(model: Optional[str]) -> str:
    if model is not None:
        return model
    from pagedserve.loader.default_model import default_model_path

    return os.path.splitext(os.path.basename(default_model_path()))[0]


def server_config(args) -> ServerConfig:
    keys = list(getattr(args, "api_key", None) or [])
    if not keys and os.environ.get("PAGEDSERVE_API_KEY"):
        keys = [os.environ["PAGEDSERVE_API_KEY"]]
    names = list(getattr(args, "served_model_name", None) or []) or [default_model_name(getattr(args, "model", None))]
    return ServerConfig(served_model_names=names, max_logprobs=getattr(args, "max_logprobs", 20),
                        max_body_bytes=getattr(args, "max_request_body_bytes", DEFAULT_MAX_BODY_BYTES),
                        api_keys=keys, log_requests=not getattr(args, "disable_log_requests", False),
                        api_keys_file=getattr(args, "api_keys_file", None),
                        scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
                        max_metric_tenants=getattr(args, "max_metric_tenants", DEFAULT_MAX_METRIC_TENANTS),
                        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                        tool_call_parser=getattr(args, "tool_call_parser", None) or "hermes",
                        log_prompts=getattr(args, "log_prompts", False),
                        max_log_len=getattr(args, "max_log_len", None),
                        request_body_timeout=getattr(args, "timeout_request_body", 30.0))


def tenant_store(config: ServerConfig) -> TenantStore:
    """The server's tenants (ValueError on a bad keys file, so that a server with bad keys never starts)."""
    def on_load(registry: TenantRegistry) -> None:
        ignored = [t.name for t in registry.tenants if t.priority != 0]
        if ignored and config.scheduling_policy == "fcfs":
            logger.warning("--scheduling-policy fcfs ignores the default priority of tenant(s) %s (start with "
                           "--scheduling-policy priority or fair to use it)", ", ".join(sorted(ignored)))

    return TenantStore(config.api_keys, config.api_keys_file, on_load)


async def _read_body(request: Request, config: ServerConfig) -> bytes:
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > config.max_body_bytes:
            raise OpenAIError(f"The request body is over the limit of {config.max_body_bytes} bytes.", 413,
                              code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_content_type(request: Request) -> None:
    """A body that says it is not JSON is refused rather than parsed anyway: a web page can post text/plain or a
    form to this server from another origin without the browser asking first (CSRF); an absent type is JSON."""
    given = request.headers.get("content-type")
    media = (given or "application/json").split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise OpenAIError(f"Content-Type must be application/json, got {given!r}", 400, param="Content-Type")


def _no_duplicate_keys(pairs: list) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise OpenAIError(f"The request body gives `{key}` twice: a JSON object's keys must be unique.", 400,
                              param=key)
        seen[key] = value
    return seen


async def _read_json(request: Request, config: ServerConfig, model_cls):
    _check_content_type(request)
    try:
        body = await asyncio.wait_for(_read_body(request, config), config.request_body_timeout)
    except asyncio.TimeoutError:
        raise OpenAIError(f"The request body did not arrive within {config.request_body_timeout:g} s "
                          "(--timeout-request-body).", 408, code="request_timeout") from None
    try:
        data = json.loads(body, object_pairs_hook=_no_duplicate_keys)
    except ValueError as e:
        raise OpenAIError(f"The request body is not valid JSON: {e}", 400) from None
    except RecursionError:
        raise OpenAIError("The request body is nested too deeply.", 400) from None
    if not isinstance(data, dict):
        raise OpenAIError("The request body must be a JSON object.", 400)
    _check_unicode(data)
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _check_unicode(data: dict) -> None:
    """JSON may spell a lone UTF-16 surrogate (\\ud800) that is no character at all: refuse it here (naming the
    field), before a tokenizer or a template fails on it. Iterative: any depth json accepted is walked."""
    stack = [(key, value) for key, value in data.items()]
    while stack:
        field, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise OpenAIError(f"`{field}` contains a lone surrogate (a \\ud800-\\udfff escape that is not "
                                  "half of a pair): not valid Unicode.", 400, param=field) from None
        elif isinstance(value, dict):
            stack.extend((field, v) for v in value.values())
            stack.extend((field, k) for k in value)
        elif isinstance(value, list):
            stack.extend((field, v) for v in value if not isinstance(v, (int, float)))


def build_app(async_llm: AsyncLLM, args, metrics: Optional[PrometheusStatLogger] = None,
              tenants: Optional[TenantStore] = None, rate_limiter: Optional[RateLimiter] = None,
              render_metrics: Optional[Callable[[], Awaitable[bytes]]] = None) -> FastAPI:
    """The app over a running AsyncLLM (or an object with its face: distributed.RemoteEngine). `tenants`
    (default: from args), `metrics` and `rate_limiter` (its clock is what tests move) may be given;
    `render_metrics` replaces the /metrics body (the Ray ingress adds its replicas' metrics)."""
    config = server_config(args)
    tenants = tenants or tenant_store(config)
    enable_lora = bool(getattr(args, "enable_lora", False))
    metrics = metrics or PrometheusStatLogger(config.served_model_names[0], max_tenants=config.max_metric_tenants,
                                              max_loras=getattr(args, "max_loras", 1) if enable_lora else None)
    allowed_lora_dirs = resolved_dirs(getattr(args, "allowed_lora_dirs", None) or [], "--allowed-lora-dirs")
    lora_modules = LoRAModules(async_llm, config.served_model_names, enable_lora, allowed_lora_dirs)
    lora_modules.load_at_start(list(getattr(args, "lora_modules", None) or []))
    rate_limiter = rate_limiter or RateLimiter()
    if getattr(async_llm, "info", None) is not None:
        metrics.log_cache_config(async_llm.info)
    async_llm.stat_loggers.append(metrics)
    if hasattr(async_llm, "restart_listeners"):
        async_llm.restart_listeners.append(lambda _count: metrics.engine_restarts.inc())
    app = FastAPI(title="pagedserve", version=pagedserve.__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.async_llm, app.state.config, app.state.metrics = async_llm, config, metrics
    app.state.tenants, app.state.rate_limiter, app.state.reload_keys = tenants, rate_limiter, tenants.reload
    _add_error_handlers(app)
    app.state.lora_modules = lora_modules
    _add_info_routes(app, async_llm, args, config, lora_modules, render_metrics or _rendered(metrics))
    _add_generation_routes(app, async_llm, config, lora_modules, metrics)
    _add_admin_routes(app, async_llm)
    if getattr(args, "allow_runtime_lora_updating", False):
        _add_lora_routes(app, config, lora_modules)
    if getattr(args, "enable_fault_injection", False):
        _add_fault_route(app, async_llm, config)
    install_openapi(app)
    request_log = RequestLog(RequestLogConfig(config.log_requests, config.log_prompts, config.max_log_len))
    app.add_middleware(Gate, max_body_bytes=config.max_body_bytes, metrics=metrics, tenants=tenants,
                       rate_limiter=rate_limiter, request_log=request_log)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_, e: OpenAIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        return error_response(str(e.detail), e.status_code)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_, e):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        logger.exception("unhandled error")
        return error_response(f"internal server error: {e!r}", 500)


def _rendered(metrics: PrometheusStatLogger) -> Callable[[], Awaitable[bytes]]:
    async def render() -> bytes:
        return metrics.render()
    return render


def _add_info_routes(app: FastAPI, async_llm: AsyncLLM, args, config: ServerConfig, lora_modules: LoRAModules,
                     render_metrics: Callable[[], Awaitable[bytes]]) -> None:
    started = int(time.time())

    @app.get("/health")
    async def health():
        if async_llm.is_alive():
            # text/plain: a Prometheus job can scrape /health as a probe (an empty scrape; `up` is its status)
            return Response(status_code=200, media_type="text/plain")
        return error_response("the engine loop is not running", 503, code="engine_dead")

    @app.get("/version")
    async def version():
        return {"version": pagedserve.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(await render_metrics(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "pagedserve",
             "root": getattr(args, "model", None) or config.served_model_names[0],
             "max_model_len": async_llm.max_model_len} for name in config.served_model_names]
            + lora_modules.model_cards(started)}


def _add_generation_routes(app: FastAPI, async_llm: AsyncLLM, config: ServerConfig, lora_modules: LoRAModules,
                           metrics: PrometheusStatLogger) -> None:
    tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-tokenizer")  # one: see ServingBase
    completions = ServingCompletion(async_llm, config, lora_modules, tokenizer_thread)
    chat = ServingChat(async_llm, config, lora_modules, tokenizer_thread)
    completions.lora_metrics = chat.lora_metrics = metrics.lora

    @app.post("/v1/completions")
    async def create_completion(request: Request):
        return await completions.create(await _read_json(request, config, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        return await chat.create(await _read_json(request, config, ChatCompletionRequest), request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _read_json(request, config, TokenizeRequest)
        chat.model_name(body.model)
        chat.need_tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", 400, param="prompt")
        if body.messages is not None:
            _, tokens = await chat.off_loop(chat.render, body.messages, body.add_generation_prompt)
        else:
            tokens = await chat.off_loop(chat.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": async_llm.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _read_json(request, config, DetokenizeRequest)
        chat.model_name(body.model)
        chat.need_tokenizer()
        chat.check_token_ids(body.tokens, "tokens")
        return {"prompt": await chat.off_loop(chat.tokenizer.decode, body.tokens)}


def _add_admin_routes(app: FastAPI, async_llm: AsyncLLM) -> None:
    """The routes of ADMIN_ROUTES (the gate refuses user keys before they get here)."""

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        # A call into the core process that waits for its reply: off the event loop.
        try:
            done = await asyncio.to_thread(async_llm.reset_prefix_cache)
        except Exception as e:  # noqa: BLE001 - a dead or unresponsive core
            raise OpenAIError(f"the engine could not reset its prefix cache: {e}", 503, code="engine_dead") from e
        if not done:
            raise OpenAIError("the prefix cache was not reset: running requests hold cached blocks; retry when "
                              "they have finished", 409, code="prefix_cache_in_use")
        return Response(status_code=200, media_type="text/plain")


def _add_lora_routes(app: FastAPI, config: ServerConfig, lora_modules: LoRAModules) -> None:
    """vLLM's runtime adapter routes (with --allow-runtime-lora-updating; admin keys only, see ADMIN_ROUTES)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await _read_json(request, config, LoadLoRAAdapterRequest)
        await lora_modules.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await _read_json(request, config, UnloadLoRAAdapterRequest)
        await lora_modules.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _add_fault_route(app: FastAPI, async_llm: AsyncLLM, config: ServerConfig) -> None:
    """POST /debug/inject_fault (--enable-fault-injection; admin keys only): make the engine fail, to test what
    the server does then (503s, /health, --restart-on-engine-failure)."""

    @app.post("/debug/inject_fault")
    async def inject_fault(request: Request):
        body = await _read_json(request, config, InjectFaultRequest)
        if not hasattr(async_llm, "inject_fault"):
            raise OpenAIError("this engine cannot inject faults (scale-out on Ray: kill a replica instead)", 400)
        if not async_llm.is_alive():
            raise OpenAIError("the engine is not running", 503, code="engine_dead")
        async_llm.inject_fault(body.fault)
        return {"fault": body.fault}
