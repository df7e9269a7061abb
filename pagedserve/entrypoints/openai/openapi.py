"""The server's OpenAPI schema (`GET /openapi.json`, behind the API key like every route but /health).

The routes read their bodies themselves (a size limit, a read timeout, duplicate-key and lone-surrogate checks:
api_server._read_json), so FastAPI cannot see them: `install_openapi` puts each POST route's request model
(protocol.py) into the schema, and every route's responses: its 200 (the models below, or an event stream, or
plain text) and OpenAI's error body for every error status."""

from __future__ import annotations

from typing import Literal, Optional, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pagedserve.entrypoints.openai import protocol


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    """OpenAI's error body, for every 4xx and 5xx."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]
    token_ids: Optional[list[int]] = None
    prompt_token_ids: Optional[list[int]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str]
    tool_calls: Optional[list[ToolCall]] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]
    token_ids: Optional[list[int]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: Optional[list[int]] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: Optional[str] = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class InjectFaultResponse(BaseModel):
    fault: str


_JSON, _TEXT, _SSE = "application/json", "text/plain", "text/event-stream"
_REQUESTS = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest,
             "/tokenize": protocol.TokenizeRequest, "/detokenize": protocol.DetokenizeRequest,
             "/v1/load_lora_adapter": protocol.LoadLoRAAdapterRequest,
             "/v1/unload_lora_adapter": protocol.UnloadLoRAAdapterRequest,
             "/debug/inject_fault": protocol.InjectFaultRequest}
_OK = {"/v1/completions": (CompletionResponse, True), "/v1/chat/completions": (ChatCompletionResponse, True),
       "/tokenize": (TokenizeResponse, False), "/detokenize": (DetokenizeResponse, False),
       "/v1/models": (ModelList, False), "/version": (VersionResponse, False),
       "/debug/inject_fault": (InjectFaultResponse, False)}
"""Route -> its 200 body's model, and whether `stream: true` makes it an event stream instead."""
_TEXT_OK = ("/health", "/metrics", "/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def install_openapi(app: FastAPI) -> None:
    """Serve the complete schema (built once, on first request) at /openapi.json."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app)
        return app.openapi_schema

    app.openapi = openapi


def build_schema(app: FastAPI) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="pagedserve's OpenAI-compatible API (with vLLM's extra fields).")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            if method == "post" and path in _REQUESTS:
                operation["requestBody"] = {"required": True, "content": {
                    _JSON: {"schema": _ref(_REQUESTS[path], components)}}}
            operation["responses"] = _responses(path, components)
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    if any(p != "/health" for p in schema.get("paths", {})):
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                if path != "/health":
                    operation["security"] = [{"bearer": []}]
    return schema


def _responses(path: str, components: dict) -> dict:
    error = {"description": "an error, with OpenAI's body", "content": {_JSON: {"schema": _ref(ErrorResponse,
                                                                                                  components)}}}
    if path in _OK:
        model, streams = _OK[path]
        content = {_JSON: {"schema": _ref(model, components)}}
        if streams:
            # with stream: true: server-sent events, each `data: {chunk as JSON}` (an `error` object for an error
            # met after the 200), the last `data: [DONE]`
            content[_SSE] = {"schema": {"type": "object", "required": ["data"],
                                        "properties": {"data": {"type": "string"}}}}
        ok = {"description": "OK", "content": content}
    elif path in _TEXT_OK:
        ok = {"description": "OK", "content": {_TEXT: {"schema": {"type": "string"}}}}
    else:
        ok = {"description": "OK"}
    return {"200": ok, "default": error}


def _ref(model: type[BaseModel], components: dict) -> dict:
    """A $ref to `model` in components.schemas, adding it and the models it uses."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
    for name, definition in schema.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components.setdefault(model.__name__, schema)
    return {"$ref": f"#/components/schemas/{model.__name__}"}
