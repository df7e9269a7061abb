"""The server's OpenAPI schema (`GET /openapi.json`, behind the API key like every route but /health).

The routes read their bodies themselves (a size limit, a read timeout, duplicate-key and lone-surrogate checks:
api_server._read_json), so FastAPI cannot see them: `install_openapi` puts each POST route's request model
(protocol.py) into the schema, and every route's responses (_ROUTES): its 200 (the models below, an event stream
of their chunks, or plain text) and each error status it may answer, with OpenAI's error body. The serving
modules build their bodies as plain dicts; the models here only describe them, exactly (no other field may
appear: additionalProperties false), and test_openapi.py has schemathesis check that they do.

Every `$ref` is `#/components/schemas/<Model>`: pydantic's `$defs` become components.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from pagedserve.entrypoints.openai import protocol
from pagedserve.entrypoints.openai.gate import ADMIN_ROUTES, OPEN_ROUTES
from pagedserve.entrypoints.openai.rate_limits import RATE_LIMITED_ROUTES
from pagedserve.entrypoints.openai.request_context import REQUEST_ID_HEADER, REQUEST_ID_PATTERN
from pagedserve.entrypoints.openai.serving_base import MAX_N, MAX_STOP, MAX_STOP_LENGTH
from pagedserve.entrypoints.openai.serving_completion import MAX_PROMPTS

REF = "#/components/schemas/{model}"
SECURITY_SCHEME = "bearer"


def _no_default(schema: dict) -> None:
    schema.pop("default", None)


def absent(description: str):
    """A field the server leaves out unless asked for: not required, and never null when it is there."""
    return Field(default=None, description=description, json_schema_extra=_no_default)


class _Out(BaseModel):
    """A response body: exactly these fields (additionalProperties false), so that the document stays exact."""

    model_config = ConfigDict(extra="forbid")


FinishReason = Literal["stop", "length", "abort"]
ChatFinishReason = Optional[Union[FinishReason, Literal["tool_calls"]]]
StopReason = Union[int, str, None]
"""The stop token id or stop string that ended a choice (None: EOS, max_tokens, or not finished)."""


# -- errors -------------------------------------------------------------------------------------------------------

class ErrorDetail(_Out):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(_Out):
    """OpenAI's error body (errors.py): every 4xx and 5xx, and an error met in a stream after its 200."""

    error: ErrorDetail


# -- completions and chat -------------------------------------------------------------------------------------

class PromptTokensDetails(_Out):
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[FinishReason]
    stop_reason: StopReason
    prompt_token_ids: list[int] = absent("With return_token_ids: the prompt's token ids.")
    token_ids: list[int] = absent("With return_token_ids: the generated token ids.")


class Completion(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(_Out):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[FinishReason]
    stop_reason: StopReason
    prompt_token_ids: Optional[list[int]] = absent("With return_token_ids: the prompt's token ids in a choice's "
                                                   "first chunk, null in the others.")
    token_ids: list[int] = absent("With return_token_ids: the ids generated since this choice's last chunk.")


class CompletionChunk(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Optional[Usage] = absent("With stream_options.include_usage: null, except in the last chunk (which "
                                    "has no choices).")


class ChatTopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob]


class ChatToolCallFunction(_Out):
    name: str
    arguments: str
    """The arguments as a JSON text."""


class ChatToolCall(_Out):
    id: str
    type: Literal["function"]
    function: ChatToolCallFunction


class ChatCompletionMessage(_Out):
    role: Literal["assistant"]
    content: Optional[str]
    tool_calls: list[ChatToolCall] = absent("The tool calls parsed out of the text (with tools).")


class ChatChoice(_Out):
    index: int
    message: ChatCompletionMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: ChatFinishReason
    stop_reason: StopReason
    token_ids: list[int] = absent("With return_token_ids: the generated token ids.")


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] = absent("With return_token_ids: the rendered prompt's token ids.")


class ChatDeltaFunction(_Out):
    name: str = absent("In a call's first delta.")
    arguments: str


class ChatDeltaToolCall(_Out):
    index: int
    id: str = absent("In a call's first delta.")
    type: Literal["function"] = absent("In a call's first delta.")
    function: ChatDeltaFunction


class ChatDelta(_Out):
    role: Literal["assistant"] = absent("In a choice's first chunk.")
    content: str = absent("Text since the last chunk.")
    tool_calls: list[ChatDeltaToolCall] = absent("A tool call, whole: its name, then its arguments.")


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: ChatFinishReason
    stop_reason: StopReason = absent("In a choice's last chunk (the one with a finish_reason).")
    token_ids: list[int] = absent("With return_token_ids: the ids generated since this choice's last chunk.")


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = absent("With stream_options.include_usage: null, except in the last chunk (which "
                                    "has no choices).")
    prompt_token_ids: list[int] = absent("With return_token_ids, in the first chunk: the prompt's token ids.")


# -- the other routes ------------------------------------------------------------------------------------------

class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: str = absent("A LoRA adapter's base model.")


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Out):
    prompt: str


class VersionResponse(_Out):
    version: str


class InjectFaultResponse(_Out):
    fault: Literal["step_error", "kill"]


_JSON, _TEXT, _SSE = "application/json", "text/plain", "text/event-stream"
_ERRORS = {400: "An invalid body, parameter or X-Request-Id header.",
           401: "An invalid or missing API key (a server with keys).",
           403: "An admin route called with a user-scope key.",
           404: "The model (or LoRA adapter) does not exist.",
           408: "The request body did not arrive within --timeout-request-body.",
           409: "The resource is in use: retry when its requests have finished.",
           413: "The request body is over --max-request-body-bytes.",
           429: "A rate limit of the tenant, or the engine's queue, is full (see Retry-After).",
           503: "The engine is not running."}
_BODY_ERRORS = (400, 408, 413)
"""What reading a JSON body may answer (api_server._read_json)."""


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def _json(model: type[BaseModel]) -> dict:
    return {_JSON: {"schema": _ref(model)}}


def _text(max_length: Optional[int] = None) -> dict:
    return {_TEXT: {"schema": {"type": "string", **({} if max_length is None else {"maxLength": max_length})}}}


def _json_or_stream(model: type[BaseModel], chunk: type[BaseModel]) -> dict:
    """`model`, or with `stream: true` server-sent events: each `data` a chunk as JSON (or OpenAI's error
    object, for an error met after the 200), the last `[DONE]`. The event stream's `schema` is one event's, as
    OpenAPI 3.1 tools read it (3.2 would name it `itemSchema`, which a 3.1 document may not have)."""
    data = {"type": "string", "if": {"const": "[DONE]"},
            "else": {"contentMediaType": _JSON, "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}}
    event = {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"type": "string"}}}
    return {**_json(model), _SSE: {"schema": event}}


@dataclass(frozen=True)
class _Route:
    ok: Optional[dict]
    """The 200's content (None: an empty body without a type)."""
    errors: tuple[int, ...] = ()
    """Its error statuses, besides what the gate may answer on any route (see _gate_errors)."""
    body: Optional[type[BaseModel]] = None


_ROUTES = {
    "/health": _Route(_text(0), (503,)),
    "/version": _Route(_json(VersionResponse)),
    "/metrics": _Route(_text()),
    "/v1/models": _Route(_json(ModelList)),
    "/v1/completions": _Route(_json_or_stream(Completion, CompletionChunk), (*_BODY_ERRORS, 404, 503),
                              protocol.CompletionRequest),
    "/v1/chat/completions": _Route(_json_or_stream(ChatCompletion, ChatCompletionChunk), (*_BODY_ERRORS, 404, 503),
                                   protocol.ChatCompletionRequest),
    "/tokenize": _Route(_json(TokenizeResponse), (*_BODY_ERRORS, 404), protocol.TokenizeRequest),
    "/detokenize": _Route(_json(DetokenizeResponse), (*_BODY_ERRORS, 404), protocol.DetokenizeRequest),
    "/reset_prefix_cache": _Route(_text(0), (409, 503)),
    "/v1/load_lora_adapter": _Route(_text(), _BODY_ERRORS, protocol.LoadLoRAAdapterRequest),
    "/v1/unload_lora_adapter": _Route(_text(), (*_BODY_ERRORS, 404, 409), protocol.UnloadLoRAAdapterRequest),
    "/debug/inject_fault": _Route(_json(InjectFaultResponse), (*_BODY_ERRORS, 503), protocol.InjectFaultRequest),
}
"""Every route the app may have (the LoRA and fault routes only with their flags), by path."""
REQUEST_MODELS = tuple(route.body for route in _ROUTES.values() if route.body is not None)
RESPONSE_MODELS = (ErrorResponse, Completion, CompletionChunk, ChatCompletion, ChatCompletionChunk, ModelList,
                   TokenizeResponse, DetokenizeResponse, VersionResponse, InjectFaultResponse)


def install_openapi(app: FastAPI) -> None:
    """Serve the schema at app.openapi_url. It is built once per key state: a route needs the bearer key (and
    may answer 401) only while the server has keys, which a reload of the keys file (SIGHUP) may change."""
    built: dict[bool, dict] = {}

    def openapi() -> dict:
        keyed = app.state.tenants.registry.auth_required
        if keyed not in built:
            built[keyed] = build_schema(app, keyed)
        return built[keyed]

    app.openapi = openapi


def build_schema(app: FastAPI, keyed: bool) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="pagedserve's OpenAI-compatible API (with vLLM's extra fields).")
    components = schema.setdefault("components", {})
    components["schemas"] = component_schemas(app.state.config.max_logprobs, app.state.async_llm.vocab_size)
    if keyed:
        components["securitySchemes"] = {SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}}
    for path, operations in schema.get("paths", {}).items():
        route = _ROUTES[path]  # a KeyError here: a new route that _ROUTES does not describe yet
        for operation in operations.values():
            _describe(operation, path, route, keyed)
    return schema


def _describe(operation: dict, path: str, route: _Route, keyed: bool) -> None:
    ok = {"description": "OK", **({"content": route.ok} if route.ok is not None else {})}
    errors = sorted({*route.errors, *_gate_errors(path, keyed)})
    operation["responses"] = {"200": ok, **{str(status): {"description": _ERRORS[status], "content": _json(
        ErrorResponse)} for status in errors}}
    if route.body is not None:
        operation["requestBody"] = {"required": True, "content": _json(route.body)}
    operation["parameters"] = [{
        "name": REQUEST_ID_HEADER, "in": "header", "required": False,
        "description": "The request's id (echoed in x-request-id; the engine's request id); else a new one.",
        "schema": {"type": "string", "pattern": f"^{REQUEST_ID_PATTERN.pattern}$"}}]
    if keyed and path not in OPEN_ROUTES:
        operation["security"] = [{SECURITY_SCHEME: []}]


def _gate_errors(path: str, keyed: bool) -> tuple[int, ...]:
    """What gate.Gate may answer before a route runs: a malformed X-Request-Id (400), a Content-Length over the
    limit (413), a bad key (401), a user key on an admin route (403), a tenant's rate limit (429)."""
    errors = [400, 413]
    if keyed and path not in OPEN_ROUTES:
        errors.append(401)
    if keyed and path in ADMIN_ROUTES:
        errors.append(403)
    if path in RATE_LIMITED_ROUTES:
        errors.append(429)  # also the engine's full queue
    return tuple(errors)


_SAMPLING_BOUNDS = {"temperature": {"minimum": 0}, "top_p": {"exclusiveMinimum": 0, "maximum": 1},
                    "top_k": {"minimum": -1}, "min_p": {"minimum": 0, "maximum": 1},
                    "presence_penalty": {"minimum": -2, "maximum": 2},
                    "frequency_penalty": {"minimum": -2, "maximum": 2},
                    "repetition_penalty": {"exclusiveMinimum": 0}, "min_tokens": {"minimum": 0},
                    "seed": {"minimum": -(1 << 63), "maximum": (1 << 64) - 1}}
"""What SamplingParams._validate refuses (a 400), as JSON schema bounds."""


def component_schemas(max_logprobs: int, vocab_size: int) -> dict:
    """The request and response models' JSON schemas by name (the models they use among them), with the
    bounds that the serving modules check written into the request schemas."""
    _, top = models_json_schema([(m, "validation") for m in (*REQUEST_MODELS, *RESPONSE_MODELS)],
                                ref_template=REF)
    schemas = top["$defs"]
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    for name, logprobs in (("CompletionRequest", "logprobs"), ("ChatCompletionRequest", "top_logprobs")):
        props = schemas[name]["properties"]
        for field, bounds in _SAMPLING_BOUNDS.items():
            props[field].update(bounds)
        props["stop_token_ids"]["anyOf"][0]["items"] = token_id
        props["n"].update(minimum=1, maximum=MAX_N)
        props["max_tokens"].update(minimum=1)
        props[logprobs].update(minimum=0, maximum=max_logprobs)
        props["stop"]["anyOf"] = [_stop_bounds(s) for s in props["stop"]["anyOf"]]
    schemas["ChatCompletionRequest"]["properties"]["max_completion_tokens"].update(minimum=1)
    # a prompt: a text or token ids (or up to MAX_PROMPTS of either), none of them empty
    one = [{"type": "string", "minLength": 1}, {"type": "array", "items": token_id, "minItems": 1}]
    schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"] = [
        *one, *({"type": "array", "items": p, "minItems": 1, "maxItems": MAX_PROMPTS} for p in one)]
    schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] = token_id
    schemas["TokenizeRequest"]["properties"]["messages"]["anyOf"][0]["minItems"] = 1
    # /tokenize: exactly one of prompt and messages
    schemas["TokenizeRequest"]["oneOf"] = [{"required": [field], "properties": {field: {"not": {"type": "null"}}}}
                                           for field in ("prompt", "messages")]
    return schemas


def _stop_bounds(schema: dict) -> dict:
    if schema.get("type") == "string":
        return {**schema, "maxLength": MAX_STOP_LENGTH}
    if schema.get("type") == "array":
        return {**schema, "maxItems": MAX_STOP, "items": {**schema["items"], "maxLength": MAX_STOP_LENGTH}}
    return schema
