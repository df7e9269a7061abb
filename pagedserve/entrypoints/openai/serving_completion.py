"""POST /v1/completions: prompts (text, token ids, or lists of either) -> text_completion(s)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest

from pagedserve.entrypoints.openai.errors import OpenAIError
from pagedserve.entrypoints.openai.protocol import CompletionRequest
from pagedserve.entrypoints.openai.request_context import request_context
from pagedserve.entrypoints.openai.serving_base import (ServingBase, collect, first_output, sse, sse_events,
                                                        usage_dict)

logger = logging.getLogger(__name__)


MAX_PROMPTS = 2048
"""Prompts in one completions request (OpenAI's limit for a list of prompts)."""


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: object = None
    text_offset: int = 0
    started: bool = False
    num_sent_ids: int = 0
    """How many of token_ids earlier chunks carried (return_token_ids in a stream)."""

    def unsent_ids(self) -> list[int]:
        ids, self.num_sent_ids = self.token_ids[self.num_sent_ids:], len(self.token_ids)
        return ids


class ServingCompletion(ServingBase):
    async def create(self, body: CompletionRequest, http: HTTPRequest):
        model = self.model_name(body.model)
        if body.suffix:
            raise OpenAIError("suffix is not supported", 400, param="suffix")
        if body.echo and body.logprobs is not None:
            raise OpenAIError("echo with logprobs is not supported (this server returns no prompt logprobs)", 400,
                              param="echo")
        self.check_common(body, body.logprobs, "logprobs")
        prompts = await self.off_loop(self._prompts, body.prompt)
        constraint = await self.structured_outputs(body)
        params = [self.sampling_params(body, self.max_tokens_for(len(ids), body.max_tokens), body.logprobs,
                                       structured_outputs=constraint)
                  for _, ids in prompts]
        ctx = request_context(http)
        priority = self.request_priority(ctx, body.priority)
        ctx.record.stream = body.stream
        logger.debug("request %s (tenant %s, model %s, priority %d): %d prompt(s), %s prompt tokens, %s",
                     ctx.request_id, ctx.tenant.name, model, priority, len(prompts),
                     [len(ids) for _, ids in prompts], params[0])
        cached: dict[int, int] = {}
        stream = self.streams(ctx, prompts, params, priority, self.cache_salt(ctx, body.cache_salt), cached,
                              model)
        n = body.n
        choices = [_Choice() for _ in range(len(prompts) * n)]
        head = {"id": f"cmpl-{ctx.request_id}", "object": "text_completion", "created": self.created(),
                "model": model}
        usage = lambda: usage_dict(sum(len(ids) for _, ids in prompts),  # noqa: E731
                                   sum(len(c.token_ids) for c in choices), cached)
        echo = [(text if text is not None else self._decode(ids)) if body.echo else "" for text, ids in prompts]

        if not body.stream:
            def on_output(i, out) -> None:
                for c in out.outputs:
                    choice = choices[i * n + c.index]
                    choice.text += c.text
                    choice.token_ids += c.token_ids
                    choice.logprobs += c.logprobs or []
                    if c.finish_reason is not None:
                        choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason

            await collect(http, stream, on_output)
            out_choices = []
            for index, choice in enumerate(choices):
                offset = len(echo[index // n])
                out_choices.append({
                    "index": index, "text": echo[index // n] + choice.text,
                    "logprobs": self._logprobs(choice.token_ids, choice.logprobs, offset, body.logprobs)
                    if body.logprobs is not None else None,
                    "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})
                if body.return_token_ids:
                    out_choices[-1].update(prompt_token_ids=prompts[index // n][1], token_ids=choice.token_ids)
            return JSONResponse({**head, "choices": out_choices, "usage": usage()})

        first = await first_output(http, stream)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def render(item):
            i, out = item
            for c in out.outputs:
                index = i * n + c.index
                choice = choices[index]
                if choice.finish_reason is not None or (not c.text and not c.token_ids and c.finish_reason is None):
                    continue
                text = c.text
                if not choice.started:
                    choice.started, text = True, echo[i] + text
                    choice.text_offset = len(echo[i])
                choice.token_ids += c.token_ids
                logprobs = None
                if body.logprobs is not None:
                    logprobs = self._logprobs(c.token_ids, c.logprobs or [], choice.text_offset, body.logprobs)
                    choice.text_offset += sum(len(t) for t in logprobs["tokens"])
                if c.finish_reason is not None:
                    choice.finish_reason = c.finish_reason
                elif not text and logprobs is None:
                    continue  # tokens whose text is held back (a partial character or stop string)
                chunk = {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                if body.return_token_ids:
                    prompt_ids = prompts[i][1] if choice.num_sent_ids == 0 else None
                    chunk["choices"][0].update(prompt_token_ids=prompt_ids, token_ids=choice.unsent_ids())
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)

        final = (lambda: sse({**head, "choices": [], "usage": usage()})) if include_usage else None
        events = sse_events((), first, stream, render, final)
        return StreamingResponse(events, media_type="text/event-stream")

    def _prompts(self, prompt) -> list[tuple[Optional[str], list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError("the prompt is empty", 400, param="prompt")
        if len(prompt) > MAX_PROMPTS:  # before any tokenizing: each prompt is a request of its own
            raise OpenAIError(f"prompt takes at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}", 400,
                              param="prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((p, self.encode(p)))
            else:
                self.check_token_ids(p)
                out.append((None, list(p)))
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _logprobs(self, token_ids: list[int], positions: list, offset: int, num: int) -> dict:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, position in zip(token_ids, positions):
            sampled = position[token_id]
            token = sampled.decoded_token if sampled.decoded_token is not None else self._decode([token_id])
            tokens.append(token)
            token_logprobs.append(sampled.logprob)
            top_logprobs.append({(p.decoded_token or ""): p.logprob for tid, p in position.items()
                                 if tid == token_id or (p.rank is not None and p.rank <= num)})
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}
