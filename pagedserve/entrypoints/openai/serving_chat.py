"""POST /v1/chat/completions: messages (and tools) -> the model's chat template -> chat.completion(s), with
tool calls parsed out of the text (tool_calling/)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest

from pagedserve.entrypoints.openai.errors import OpenAIError
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedserve.entrypoints.openai.request_context import request_context
from pagedserve.entrypoints.openai.serving_base import (ServingBase, collect, first_output, sse, sse_events,
                                                        usage_dict)
from pagedserve.tool_calling.constraint import tool_constraint
from pagedserve.tool_calling.formats import FORMATS, ToolCall
from pagedserve.tool_calling.prompt import render_messages, template_knows_tools
from pagedserve.tool_calling.stream import ToolCallStream
from pagedserve.tool_calling.tools import Tool, ToolChoice, ToolError, check_tool_choice, check_tools

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: object = None
    tool_stream: Optional[ToolCallStream] = None
    num_sent_ids: int = 0
    """How many of token_ids earlier chunks carried (return_token_ids in a stream)."""

    def unsent_ids(self) -> list[int]:
        ids, self.num_sent_ids = self.token_ids[self.num_sent_ids:], len(self.token_ids)
        return ids


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI's message dicts; content as one string: text parts joined by newlines (vLLM's rule)."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "\n".join(p.text for p in m.content)
        message = {"role": m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


@dataclass(frozen=True)
class _Tools:
    tools: list[Tool]
    choice: ToolChoice

    @property
    def parsed(self) -> bool:
        """Whether the output is searched for tool calls (tools offered and not tool_choice none)."""
        return bool(self.tools) and self.choice.mode != "none"


class ServingChat(ServingBase):
    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               tools: Optional[list[Tool]] = None) -> tuple[str, list[int]]:
        self.need_tokenizer()
        fmt = FORMATS[self.config.tool_call_parser]
        dicts, extra = render_messages(message_dicts(messages), tools or [], fmt,
                                       template_knows_tools(self.tokenizer.chat_template))
        try:
            text = self.tokenizer.apply_chat_template(dicts, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **extra)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation is the client's problem
            raise OpenAIError(f"the chat template failed on these messages: {e}", 400, param="messages") from None
        return text, self.encode(text, "messages", add_special_tokens=False)

    def _tools(self, body: ChatCompletionRequest) -> _Tools:
        try:
            tools = check_tools(body.tools or [])
            choice = check_tool_choice(body.tool_choice, tools)
        except ToolError as e:
            raise OpenAIError(str(e), 400, param=e.param) from None
        if choice.mode == "auto" and tools and not self.config.enable_auto_tool_choice:
            raise OpenAIError('"auto" tool choice (the default with tools) needs the server started with '
                              "--enable-auto-tool-choice; or send tool_choice required, none or a function", 400,
                              param="tool_choice")
        return _Tools(tools, choice)

    async def _constraint(self, body: ChatCompletionRequest, tools: _Tools):
        constraint = await self.structured_outputs(body)
        if not tools.parsed:
            return constraint
        if constraint is not None:
            raise OpenAIError(f"tool_choice {tools.choice.mode!r} cannot be combined with response_format or "
                              "structured_outputs", 400, param="tool_choice")
        return tool_constraint(tools.tools, tools.choice, FORMATS[self.config.tool_call_parser],
                               body.parallel_tool_calls)

    async def create(self, body: ChatCompletionRequest, http: HTTPRequest):
        model = self.model_name(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", 400, param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        self.check_common(body, logprobs, "top_logprobs")
        tools = self._tools(body)
        text, ids = await self.off_loop(self.render, body.messages, body.add_generation_prompt, tools.tools)
        self.check_token_ids(ids, "messages")
        if body.max_completion_tokens is not None:
            max_tokens = self.max_tokens_for(len(ids), body.max_completion_tokens, "max_completion_tokens")
        else:
            max_tokens = self.max_tokens_for(len(ids), body.max_tokens)
        params = self.sampling_params(body, max_tokens, logprobs, rename={"logprobs": "top_logprobs"},
                                      structured_outputs=await self._constraint(body, tools))
        ctx = request_context(http)
        priority = self.request_priority(ctx, body.priority)
        ctx.record.stream = body.stream
        logger.debug("request %s (tenant %s, model %s, priority %d): %d prompt tokens, %s", ctx.request_id,
                     ctx.tenant.name, model, priority, len(ids), params)
        cached: dict[int, int] = {}
        stream = self.streams(ctx, [(text, ids)], [params], priority, self.cache_salt(ctx, body.cache_salt), cached,
                              model)
        fmt = FORMATS[self.config.tool_call_parser]
        choices = [_Choice(tool_stream=ToolCallStream(fmt) if tools.parsed else None) for _ in range(body.n)]
        head = {"id": f"chatcmpl-{ctx.request_id}", "created": self.created(), "model": model}
        usage = lambda: usage_dict(len(ids), sum(len(c.token_ids) for c in choices), cached)  # noqa: E731
        if body.return_token_ids:
            head["prompt_token_ids"] = ids  # a stream's first chunk only (see _stream)
        if not body.stream:
            return await self._complete(http, stream, choices, logprobs, head, usage, body.return_token_ids)
        return await self._stream(http, stream, choices, logprobs, head, usage, body)

    async def _complete(self, http, stream, choices: list[_Choice], logprobs, head: dict, usage,
                        return_token_ids: bool) -> JSONResponse:
        def on_output(_, out) -> None:
            for c in out.outputs:
                choice = choices[c.index]
                choice.text += c.text
                choice.token_ids += c.token_ids
                if logprobs is not None:
                    choice.logprobs += self._logprobs(c.token_ids, c.logprobs or [], logprobs)
                if c.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason

        await collect(http, stream, on_output)
        rendered = []
        for i, c in enumerate(choices):
            message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
            if c.tool_stream is not None:
                parsed = c.tool_stream.fmt.parse(c.text, final=True)
                if parsed.calls:
                    message = {"role": "assistant", "content": parsed.content or None,
                               "tool_calls": [call.openai() for call in parsed.calls]}
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            rendered.append({"index": i, "message": message,
                             "logprobs": {"content": c.logprobs} if logprobs is not None else None,
                             "finish_reason": finish_reason, "stop_reason": c.stop_reason})
            if return_token_ids:
                rendered[-1]["token_ids"] = c.token_ids
        return JSONResponse({**head, "object": "chat.completion", "choices": rendered, "usage": usage()})

    async def _stream(self, http, stream, choices: list[_Choice], logprobs, head: dict, usage,
                      body: ChatCompletionRequest) -> StreamingResponse:
        first = await first_output(http, stream)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        first_head = head
        head = {k: v for k, v in head.items() if k != "prompt_token_ids"}

        def chunk(index: int, delta: dict, finish_reason=None, stop_reason=None, lps=None) -> str:
            nonlocal first_head
            payload = {**first_head, "object": "chat.completion.chunk", "choices": [
                {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish_reason,
                 **({"stop_reason": stop_reason} if finish_reason is not None else {})}]}
            first_head = head
            if body.return_token_ids:  # the ids since this choice's last chunk (held-back text's ids wait)
                payload["choices"][0]["token_ids"] = choices[index].unsent_ids()
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        def render(item):
            for c in item[1].outputs:
                choice = choices[c.index]
                if choice.finish_reason is not None or (not c.text and not c.token_ids and c.finish_reason is None):
                    continue
                choice.token_ids += c.token_ids
                lps = None
                if logprobs is not None:
                    lps = {"content": self._logprobs(c.token_ids, c.logprobs or [], logprobs)}
                choice.finish_reason = c.finish_reason
                if choice.tool_stream is not None:
                    yield from _tool_chunks(chunk, c, choice, lps)
                    continue
                if not c.text and c.finish_reason is None and lps is None:
                    continue  # tokens whose text is held back (a partial character or stop string)
                yield chunk(c.index, {"content": c.text} if c.text or c.finish_reason is None else {},
                            c.finish_reason, c.stop_reason, lps)

        roles = [chunk(i, {"role": "assistant", "content": ""}) for i in range(body.n)]
        final = (lambda: sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage()})
                 ) if include_usage else None
        events = sse_events(roles, first, stream, render, final)
        return StreamingResponse(events, media_type="text/event-stream")

    def _logprobs(self, token_ids: list[int], positions: list, num: int) -> list[dict]:
        out = []
        for token_id, position in zip(token_ids, positions):
            sampled = position[token_id]
            top = sorted((p for p in position.values() if p.rank is not None and p.rank <= num),
                         key=lambda p: p.rank)
            token = sampled.decoded_token if sampled.decoded_token is not None else self.tokenizer.decode([token_id])
            out.append({"token": token, "logprob": sampled.logprob, "bytes": list(token.encode()),
                        "top_logprobs": [{"token": p.decoded_token or "", "logprob": p.logprob,
                                          "bytes": list((p.decoded_token or "").encode())} for p in top][:num]})
        return out


def _tool_chunks(chunk, c, choice: _Choice, lps):
    """A delta of a choice whose text may hold tool calls: its certain content, then each completed call as
    OpenAI's delta.tool_calls (index, id, type and name first, then the arguments), then the finish."""
    finished = c.finish_reason is not None
    content, calls = choice.tool_stream.feed(c.text, finished)
    if content or lps is not None:
        yield chunk(c.index, {"content": content}, lps=lps)
    first_index = len(choice.tool_stream.calls) - len(calls)
    for offset, call in enumerate(calls):
        yield from _call_chunks(chunk, c.index, first_index + offset, call)
    if finished:
        finish_reason = c.finish_reason
        if choice.tool_stream.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        yield chunk(c.index, {}, finish_reason, c.stop_reason)


def _call_chunks(chunk, index: int, call_index: int, call: ToolCall):
    yield chunk(index, {"tool_calls": [{"index": call_index, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
    yield chunk(index, {"tool_calls": [{"index": call_index, "function": {"arguments": call.arguments}}]})
