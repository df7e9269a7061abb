"""The FastAPI app: routes, API-key auth, body-size limit, OpenAI-shaped errors, HTTP metrics.

`build_app(async_llm, args)` takes the AsyncLLM (already running) and the parsed `pagedserve serve` args; it
does not own the engine: whoever built the AsyncLLM shuts it down.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import time
from typing import Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

import pagedserve
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.errors import OpenAIError, error_response, from_validation_error
from pagedserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                    TokenizeRequest)
from pagedserve.entrypoints.openai.serving_base import ClientDisconnected, ServerConfig
from pagedserve.entrypoints.openai.serving_chat import ServingChat
from pagedserve.entrypoints.openai.serving_completion import ServingCompletion
from pagedserve.metrics.prometheus import CONTENT_TYPE, PrometheusStatLogger

logger = logging.getLogger(__name__)

ROUTES = ("/health", "/version", "/metrics", "/tokenize", "/detokenize", "/v1/models", "/v1/completions",
          "/v1/chat/completions")
OPEN_ROUTES = ("/health",)
DEFAULT_MAX_BODY_BYTES = 16 << 20


def default_model_name(model: Optional[str]) -> str:
    if model is not None:
        return model
    from pagedserve.loader.model_loader import default_model_path

    return os.path.splitext(os.path.basename(default_model_path()))[0]


def server_config(args) -> ServerConfig:
    keys = list(getattr(args, "api_key", None) or [])
    if not keys and os.environ.get("PAGEDSERVE_API_KEY"):
        keys = [os.environ["PAGEDSERVE_API_KEY"]]
    names = list(getattr(args, "served_model_name", None) or []) or [default_model_name(getattr(args, "model", None))]
    return ServerConfig(served_model_names=names, max_logprobs=getattr(args, "max_logprobs", 20),
                        max_body_bytes=getattr(args, "max_request_body_bytes", DEFAULT_MAX_BODY_BYTES),
                        api_keys=keys, log_requests=not getattr(args, "disable_log_requests", False))


class _Gate:
    """Pure ASGI middleware (it must not buffer streams): counts every HTTP request by route and status,
    checks the API key, and refuses bodies whose Content-Length is over the limit."""

    def __init__(self, app, config: ServerConfig, metrics: PrometheusStatLogger) -> None:
        self.app, self.config, self.metrics = app, config, metrics
        self._keys = [k.encode() for k in config.api_keys]

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        ok = False
        for key in self._keys:  # every key is compared, in constant time
            ok |= scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)
        return ok

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        path = scope["path"]
        try:
            if self._keys and path not in OPEN_ROUTES and not self._authorized(scope):
                response = error_response("Invalid or missing API key: send `Authorization: Bearer <key>`.", 401,
                                          code="invalid_api_key")
                return await response(scope, receive, send_and_note)
            length = dict(scope.get("headers") or []).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
                return await _too_large(self.config)(scope, receive, send_and_note)
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.http_requests.labels(path if path in ROUTES else "other", scope.get("method", ""),
                                              str(status[0])).inc()


def _too_large(config: ServerConfig) -> JSONResponse:
    return error_response(f"The request body is over the limit of {config.max_body_bytes} bytes.", 413,
                          code="request_too_large")


async def _read_json(request: Request, config: ServerConfig, model_cls):
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > config.max_body_bytes:
            raise OpenAIError(f"The request body is over the limit of {config.max_body_bytes} bytes.", 413,
                              code="request_too_large")
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks))
    except ValueError as e:
        raise OpenAIError(f"The request body is not valid JSON: {e}", 400) from None
    if not isinstance(data, dict):
        raise OpenAIError("The request body must be a JSON object.", 400)
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def build_app(async_llm: AsyncLLM, args, metrics: Optional[PrometheusStatLogger] = None) -> FastAPI:
    config = server_config(args)
    metrics = metrics or PrometheusStatLogger(config.served_model_names[0])
    async_llm.stat_loggers.append(metrics)
    completions = ServingCompletion(async_llm, config)
    chat = ServingChat(async_llm, config)
    started = int(time.time())

    app = FastAPI(title="pagedserve", version=pagedserve.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.async_llm, app.state.config, app.state.metrics = async_llm, config, metrics

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

    @app.get("/health")
    async def health():
        if async_llm.is_alive():
            return Response(status_code=200)
        return error_response("the engine loop is not running", 503, code="engine_dead")

    @app.get("/version")
    async def version():
        return {"version": pagedserve.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "pagedserve",
             "root": getattr(args, "model", None) or config.served_model_names[0],
             "max_model_len": async_llm.max_model_len} for name in config.served_model_names]}

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
            _, tokens = chat.render(body.messages, body.add_generation_prompt)
        else:
            tokens = chat.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": async_llm.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _read_json(request, config, DetokenizeRequest)
        chat.model_name(body.model)
        chat.need_tokenizer()
        chat.check_token_ids(body.tokens, "tokens")
        return {"prompt": chat.tokenizer.decode(body.tokens)}

    app.add_middleware(_Gate, config=config, metrics=metrics)
    return app
