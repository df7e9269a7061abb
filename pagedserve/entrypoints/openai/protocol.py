"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Unknown fields are ignored, as OpenAI and vLLM do; known ones must have their JSON type (strict). Responses are
built as plain dicts by the serving modules, in OpenAI's shapes (described in openapi.py, as /openapi.json).
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


INT64_MAX = 2**63 - 1


class _Body(BaseModel):
    # strict: a field takes its JSON type only (as OpenAI's API does, and as the OpenAPI schema says), not
    # pydantic's coercions ("temperature": false or "0.7", "stream": 1, "n": "2" were taken as 0.0, 0.7, true, 2)
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    name: str = Field(default="response", max_length=64)
    description: Optional[str] = None
    json_schema: Optional[Union[dict, bool]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` object (exactly one of json, regex, choice, grammar, json_object)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_schema: Optional[Union[dict, bool, str]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None
    disable_any_whitespace: bool = False


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extras
    top_k: Optional[int] = Field(default=None, le=INT64_MAX)
    """At most INT64_MAX: the engine's sampling tensors are int64, and a larger top_k killed the engine core."""
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: Optional[str] = None
    priority: Optional[int] = None
    """Lower runs first; omitted: the tenant's default priority (needs --scheduling-policy priority or fair)."""
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsField] = None
    stream_interval: Optional[int] = Field(default=None, ge=1, le=INT64_MAX)
    """vLLM's: with stream, tokens per chunk (the first and last chunks at once); raises the server's
    --stream-interval for this request, never lowers it."""
    return_token_ids: bool = False
    """vLLM's: each choice also carries its generated `token_ids` (in a stream: each chunk the ids since the
    last chunk of that choice), and the response its `prompt_token_ids`."""


class CompletionRequest(_SamplingFields):
    prompt: Union[list[int], list[list[int]], str, list[str]]
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    name: str
    arguments: str = "{}"


class ToolCallItem(_Body):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallItem]] = None
    """An assistant message's past calls."""
    tool_call_id: Optional[str] = None
    """A tool message: the call it answers."""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True


class TokenizeRequest(_Body):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None  # vLLM's body may carry it; the name decides here


class InjectFaultRequest(_Body):
    """POST /debug/inject_fault (--enable-fault-injection): step_error makes the engine's next step raise;
    kill kills the engine process."""

    fault: Literal["step_error", "kill"]
