"""POST /v1/chat/completions: messages -> the model's chat template -> chat.completion(s)."""

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

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: object = None


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Content as one string: text parts joined by newlines (vLLM's rule)."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in (m.content or []))
        out.append({"role": m.role, "content": content})
    return out


class ServingChat(ServingBase):
    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        self.need_tokenizer()
        try:
            text = self.tokenizer.apply_chat_template(message_dicts(messages), tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation is the client's problem
            raise OpenAIError(f"the chat template failed on these messages: {e}", 400, param="messages") from None
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    async def create(self, body: ChatCompletionRequest, http: HTTPRequest):
        model = self.model_name(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", 400, param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        self.check_common(body, logprobs, "top_logprobs")
        text, ids = self.render(body.messages, body.add_generation_prompt)
        self.check_token_ids(ids, "messages")
        if body.max_completion_tokens is not None:
            max_tokens = self.max_tokens_for(len(ids), body.max_completion_tokens, "max_completion_tokens")
        else:
            max_tokens = self.max_tokens_for(len(ids), body.max_tokens)
        params = self.sampling_params(body, max_tokens, logprobs, rename={"logprobs": "top_logprobs"})
        ctx = request_context(http)
        priority = self.request_priority(ctx, body.priority)
        if self.config.log_requests:
            logger.info("request %s (tenant %s, model %s, priority %d): %d prompt tokens, %s", ctx.request_id,
                        ctx.tenant.name, model, priority, len(ids), params)
        cached: dict[int, int] = {}
        stream = self.streams(ctx, [(text, ids)], [params], priority, self.cache_salt(ctx, body.cache_salt), cached,
                              model)
        choices = [_Choice() for _ in range(body.n)]
        head = {"id": f"chatcmpl-{ctx.request_id}", "created": self.created(), "model": model}
        usage = lambda: usage_dict(len(ids), sum(c.num_tokens for c in choices), cached)  # noqa: E731

        if not body.stream:
            def on_output(_, out) -> None:
                for c in out.outputs:
                    choice = choices[c.index]
                    choice.text += c.text
                    choice.num_tokens += len(c.token_ids)
                    if logprobs is not None:
                        choice.logprobs += self._logprobs(c.token_ids, c.logprobs or [], logprobs)
                    if c.finish_reason is not None:
                        choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason

            await collect(http, stream, on_output)
            return JSONResponse({**head, "object": "chat.completion", "choices": [
                {"index": i, "message": {"role": "assistant", "content": c.text},
                 "logprobs": {"content": c.logprobs} if logprobs is not None else None,
                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                for i, c in enumerate(choices)], "usage": usage()})

        first = await first_output(http, stream)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(index: int, delta: dict, finish_reason=None, stop_reason=None, lps=None) -> str:
            payload = {**head, "object": "chat.completion.chunk", "choices": [
                {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish_reason,
                 **({"stop_reason": stop_reason} if finish_reason is not None else {})}]}
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        def render(item):
            for c in item[1].outputs:
                choice = choices[c.index]
                if choice.finish_reason is not None or (not c.text and not c.token_ids and c.finish_reason is None):
                    continue
                choice.num_tokens += len(c.token_ids)
                lps = None
                if logprobs is not None:
                    lps = {"content": self._logprobs(c.token_ids, c.logprobs or [], logprobs)}
                choice.finish_reason = c.finish_reason
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
