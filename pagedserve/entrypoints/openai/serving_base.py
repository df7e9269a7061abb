"""What completions and chat share: the server's limits, model names, prompt checks, SamplingParams, and the
async plumbing (several engine streams merged into one, a client disconnect cancelling the work)."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Optional, TypeVar

from starlette.requests import Request as HTTPRequest

from pagedserve.core.request import RequestIdInUseError
from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from pagedserve.entrypoints.openai.errors import OpenAIError, from_value_error
from pagedserve.entrypoints.openai.request_context import REQUEST_ID_HEADER, RequestContext
from pagedserve.logging_utils.request_log import RequestRecord
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.params import StructuredOutputsParams

T = TypeVar("T")

MAX_N = 128
MAX_STOP = 16
MAX_STOP_LENGTH = 1024


@dataclass
class ServerConfig:
    served_model_names: list[str]
    max_logprobs: int = 20
    max_body_bytes: int = 16 << 20
    api_keys: list[str] = field(default_factory=list)
    """The `--api-key` keys (admin scope, tenant "default")."""
    log_requests: bool = True
    api_keys_file: Optional[str] = None
    """The keys file of named tenants (`pagedserve/tenants/keys_file.py`), re-read on SIGHUP."""
    scheduling_policy: str = "fcfs"
    """The engine's policy: under "fcfs" tenants' default priorities are not passed on."""
    max_metric_tenants: int = 32
    enable_auto_tool_choice: bool = False
    tool_call_parser: str = "hermes"
    log_prompts: bool = False
    """Keep prompt and completion text in the access log (--log-prompts); off: token counts only."""
    max_log_len: Optional[int] = None
    request_body_timeout: float = 30.0
    """Seconds a request body may take to arrive (--timeout-request-body); then 408."""


class ClientDisconnected(Exception):
    pass


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


NORMALIZER_SLACK = 4
"""How many characters a tokenizer's normalizer may fold into one (NFC, NFKC): the length check stays sound."""


class ServingBase:
    def __init__(self, async_llm: AsyncLLM, config: ServerConfig, lora_modules=None,
                 tokenizer_thread: Optional[ThreadPoolExecutor] = None) -> None:
        self.async_llm = async_llm
        self.tokenizer_thread = tokenizer_thread or ThreadPoolExecutor(1, thread_name_prefix="pagedserve-tokenizer")
        """Where prompts are templated and tokenized (off_loop): one thread, shared by the routes, so that the
        tokenizer is never used from two threads at once."""
        self.config = config
        self.lora_modules = lora_modules
        """The served LoRA adapters (lora_modules.LoRAModules), or None."""
        self.lora_metrics = None
        """Per-adapter counters (metrics.prometheus.LoRAMetrics), or None."""
        # The event loop's tokenizer (AsyncLLM's output thread detokenizes with another copy).
        self.tokenizer = async_llm.input_processor.tokenizer
        self.max_model_len = async_llm.max_model_len
        self.vocab_size = async_llm.vocab_size
        self._max_prompt_chars: Optional[int] = None

    # -- checks ------------------------------------------------------------------------------------------------

    def model_name(self, requested: Optional[str]) -> str:
        """The served name a request's `model` means (a base model name or a LoRA adapter's); 404 otherwise."""
        if requested is None:
            return self.config.served_model_names[0]
        lora = self.lora_modules
        if requested not in self.config.served_model_names and (lora is None or lora.get(requested) is None):
            served = self.config.served_model_names + (lora.names if lora is not None else [])
            raise OpenAIError(f"The model `{requested}` does not exist. Served: {', '.join(served)}", 404,
                              param="model", code="model_not_found")
        return requested

    def lora_request(self, model: str):
        """The LoRARequest a served name selects (None: the base model)."""
        return self.lora_modules.get(model) if self.lora_modules is not None else None

    def need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise OpenAIError("this server was started without a tokenizer: only token-id prompts work", 400)

    async def off_loop(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on the tokenizer thread: tokenizing a long prompt (tens of ms per 100 KB) or
        rendering a big conversation would otherwise hold the event loop that serves every other client."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread,
                                                                functools.partial(fn, *args, **kwargs))

    def encode(self, text: str, param: str = "prompt", **kwargs) -> list[int]:
        """A client's text as token ids; refused before tokenizing when its length alone rules it out, so that a
        huge prompt costs a length check, not seconds of tokenizer time."""
        self.need_tokenizer()
        limit = self.max_prompt_chars()
        if len(text) > limit:
            raise OpenAIError(f"The {param} is {len(text)} characters long; this model's {self.max_model_len}-token "
                              f"context holds at most {limit}. Please shorten it.", 400, param=param)
        return self.tokenizer.encode(text, **kwargs)

    def max_prompt_chars(self) -> int:
        """Characters beyond which a text cannot fit the context: no token spells more than the longest entry of
        the vocabulary (times NORMALIZER_SLACK, for normalizers that merge characters)."""
        if self._max_prompt_chars is None:
            longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
            self._max_prompt_chars = NORMALIZER_SLACK * longest * self.max_model_len
        return self._max_prompt_chars

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIError(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}", 400, param=param)

    def max_tokens_for(self, num_prompt_tokens: int, max_tokens: Optional[int], param: str = "max_tokens") -> int:
        """The effective max_tokens (omitted = the rest of the context); 400 when it cannot fit."""
        if num_prompt_tokens == 0:
            raise OpenAIError("the prompt is empty", 400, param="prompt")
        if max_tokens is not None and max_tokens < 1:
            raise OpenAIError(f"{param} must be at least 1, got {max_tokens}", 400, param=param)
        wanted = max_tokens if max_tokens is not None else 1
        if num_prompt_tokens + wanted > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + wanted} tokens ({num_prompt_tokens} in the prompt, {wanted} for the "
                f"completion). Please reduce the length of the prompt or {param}.", 400, param=param)
        return max_tokens if max_tokens is not None else self.max_model_len - num_prompt_tokens

    def check_common(self, body, logprobs: Optional[int], logprobs_param: str) -> None:
        if not 1 <= body.n <= MAX_N:
            raise OpenAIError(f"n must be between 1 and {MAX_N}, got {body.n}", 400, param="n")
        if logprobs is not None and not 0 <= logprobs <= self.config.max_logprobs:
            raise OpenAIError(f"{logprobs_param} must be between 0 and {self.config.max_logprobs} "
                              f"(--max-logprobs), got {logprobs}", 400, param=logprobs_param)
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise OpenAIError(f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_LENGTH} characters",
                              400, param="stop")

    async def structured_outputs(self, body) -> Optional[StructuredOutputsParams]:
        """The request's constraint, from OpenAI's `response_format` or vLLM's `structured_outputs` (one of
        them), checked as the engine will compile it: 400 naming the field when it cannot be served. The check
        runs off the event loop, within the compile time limit (a huge regex takes seconds to expand)."""
        param = "response_format" if body.structured_outputs is None else "structured_outputs"
        try:
            constraint = self._constraint_of(body)
            if constraint is None:
                return None
            limit = self.async_llm.config.structured_outputs_config.structured_outputs_compile_timeout
            check = self.async_llm.input_processor.check_structured_outputs
            await asyncio.wait_for(asyncio.to_thread(check, constraint), limit)
        except asyncio.TimeoutError:
            raise OpenAIError(f"{param} took longer than {limit:g} s to check (structured_outputs_compile_timeout)",
                              400, param=param) from None
        except (ValueError, RecursionError) as e:
            raise OpenAIError(str(e), 400, param=param) from None
        return constraint

    @staticmethod
    def _constraint_of(body) -> Optional[StructuredOutputsParams]:
        fmt, so = body.response_format, body.structured_outputs
        if fmt is not None and fmt.type != "text" and so is not None:
            raise OpenAIError("give response_format or structured_outputs, not both", 400, param="structured_outputs")
        if so is not None:
            return StructuredOutputsParams(
                json=so.json_schema, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=so.json_object,
                structural_tag=so.structural_tag, disable_any_whitespace=so.disable_any_whitespace)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)

    def sampling_params(self, body, max_tokens: int, logprobs: Optional[int],
                        rename: Optional[dict[str, str]] = None,
                        structured_outputs: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        """The request's SamplingParams; `structured_outputs` is its constraint (structured_outputs(body), or
        what the chat route made of it and the tools)."""
        extras = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                  if getattr(body, k) is not None}
        try:
            return SamplingParams(
                n=body.n, seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids, max_tokens=max_tokens,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                logit_bias=body.logit_bias, min_tokens=body.min_tokens, ignore_eos=body.ignore_eos,
                skip_special_tokens=body.skip_special_tokens, logprobs=logprobs,
                include_stop_str_in_output=body.include_stop_str_in_output, stream_interval=body.stream_interval,
                structured_outputs=structured_outputs, **extras)
        except ValueError as e:
            raise from_value_error(e, rename) from None

    # -- running -----------------------------------------------------------------------------------------------

    @staticmethod
    def created() -> int:
        return int(time.time())

    @staticmethod
    def cache_salt(ctx: RequestContext, client_salt: Optional[str]) -> Optional[str]:
        """The prefix-cache salt of a request. With API keys, it is derived from the caller's tenant (a keys-file
        tenant's name; an --api-key key's own key), so that one tenant's requests never hit another's cached
        blocks (no timing side channel between tenants); a client's own `cache_salt` is added on top of the
        tenant's, never in place of it."""
        tenant_salt = ctx.tenant.cache_salt
        if tenant_salt is None:
            return client_salt
        return tenant_salt if client_salt is None else f"{tenant_salt}/{client_salt}"

    def request_priority(self, ctx: RequestContext, requested: Optional[int]) -> int:
        """The engine priority of a request (lower runs first): the body's `priority`, else the tenant's default
        (not passed on under the fcfs policy, which refuses any priority but 0). A user-scope tenant may not ask
        for better than its `min_priority`."""
        tenant = ctx.tenant
        if requested is None:
            return 0 if self.config.scheduling_policy == "fcfs" else tenant.priority
        if not tenant.is_admin and requested < tenant.min_priority:
            raise OpenAIError(f"priority {requested} is better than tenant {tenant.name} may ask for: at best "
                              f"{tenant.min_priority} (lower runs first)", 400, param="priority")
        return requested

    def streams(self, ctx: RequestContext, prompts: list[tuple[Optional[str], list[int]]],
                params: list[SamplingParams], priority: int = 0, cache_salt: Optional[str] = None,
                cached_tokens: Optional[dict[int, int]] = None,
                model: Optional[str] = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """One engine request per prompt (with its params), merged into one stream of (prompt index, delta).
        The tenant's token budget is reserved first (OpenAIError 429 when it has not enough; nothing reaches the
        engine then) and settled when the stream ends. `cached_tokens` (prompt index -> prompt tokens served
        from the prefix cache) is filled as it runs."""
        ctx.reserve_tokens(sum(len(ids) + p.max_tokens * p.n for (_, ids), p in zip(prompts, params)))
        request_id = ctx.request_id
        lora_request = self.lora_request(model) if model is not None else None
        gens = [self.async_llm.generate({"prompt": text, "prompt_token_ids": ids, "cache_salt": cache_salt}, p,
                                        request_id if len(prompts) == 1 else f"{request_id}-{i}",
                                        priority=priority, tenant=ctx.tenant.name, lora_request=lora_request)
                for i, ((text, ids), p) in enumerate(zip(prompts, params))]
        on_done = None
        if lora_request is not None and self.lora_metrics is not None:
            on_done = lambda generated: self.lora_metrics.count(lora_request.lora_name, generated)  # noqa: E731
        self._start_record(ctx.record, model, lora_request, prompts, params)
        metered = _metered(merge_streams(gens), ctx, [len(ids) for _, ids in prompts], on_done,
                           n=params[0].n, keep_text=self.config.log_prompts)
        return metered if cached_tokens is None else _noting_cached_tokens(metered, cached_tokens)

    def _start_record(self, record: RequestRecord, model: Optional[str], lora_request,
                      prompts: list[tuple[Optional[str], list[int]]], params: list[SamplingParams]) -> None:
        record.model = model or self.config.served_model_names[0]
        record.lora_adapter = lora_request.lora_name if lora_request is not None else None
        record.prompt_tokens = sum(len(ids) for _, ids in prompts)
        record.num_choices = sum(p.n for p in params)
        if self.config.log_prompts:
            record.prompts = [text if text is not None else ids for text, ids in prompts]


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: dict[int, int]) -> dict:
    """OpenAI's usage object, with the prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached_tokens.values())}}


async def _metered(stream: AsyncIterator[tuple[int, RequestOutput]], ctx: RequestContext,
                   prompt_lengths: list[int], on_done: Optional[Callable[[int], None]] = None,
                   n: int = 1, keep_text: bool = False) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Counts the tokens a request really used (the prompts that produced output, and every generated token)
    and settles the tenant's reservation with them when the stream ends: finished, failed or abandoned;
    `on_done(generated tokens)` is called then too (the per-adapter counters). The request's access-log record
    gets its first-token time, token counts and finish reasons (and its text, with `keep_text`)."""
    started: set[int] = set()
    generated = 0
    record, cached = ctx.record, {}
    try:
        async for i, out in stream:
            if out.replica is not None:
                ctx.replicas.append(out.replica)
            started.add(i)
            generated += _note_output(record, i * n, out, keep_text)
            cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
            # As it goes, not only at the end: an abandoned stream may be closed after its log line is written.
            record.completion_tokens, record.cached_tokens = generated, sum(cached.values())
            yield i, out
    finally:
        ctx.finish_tokens(sum(prompt_lengths[i] for i in started), generated)
        if on_done is not None:
            on_done(generated)
        await stream.aclose()


def _note_output(record: RequestRecord, first_choice: int, out: RequestOutput, keep_text: bool) -> int:
    """Notes one delta (of the prompt whose choices start at `first_choice`) in the access-log record; returns
    the tokens it generated."""
    tokens = 0
    for c in out.outputs:
        tokens += len(c.token_ids)
        if c.finish_reason is not None:
            record.finish_reasons[first_choice + c.index] = c.finish_reason
        if keep_text:
            record.completions[first_choice + c.index] = record.completions.get(first_choice + c.index, "") + c.text
    if tokens and record.first_token is None:
        record.first_token = time.monotonic()
    return tokens


async def _noting_cached_tokens(stream: AsyncIterator[tuple[int, RequestOutput]],
                                cached: dict[int, int]) -> AsyncIterator[tuple[int, RequestOutput]]:
    try:
        async for i, out in stream:
            cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
            yield i, out
    finally:
        await stream.aclose()


async def merge_streams(gens: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index, item) from several async iterators as items arrive. Closing this closes (aborts) them all."""
    if len(gens) == 1:
        try:
            async for item in gens[0]:
                yield 0, item
        finally:
            await gens[0].aclose()
        return
    results: asyncio.Queue = asyncio.Queue()
    _END = object()

    async def pump(i: int, gen) -> None:
        try:
            async for item in gen:
                await results.put((i, item))
            await results.put((i, _END))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await results.put((i, e))
        finally:
            await gen.aclose()

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await results.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(request: HTTPRequest, work: Awaitable[T]) -> T:
    """Run `work`; if the client goes away first, cancel it (aborting its requests) and raise
    ClientDisconnected."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task in done and not task.cancelled():
        return task.result()
    raise ClientDisconnected()


async def collect(http: HTTPRequest, stream: AsyncIterator[tuple[int, RequestOutput]],
                  on_output: Callable[[int, RequestOutput], None]) -> None:
    """Non-streaming: feed every (prompt index, delta) to `on_output` until all requests finish. Engine errors
    become HTTP errors; a client that goes away aborts the requests."""
    async def run() -> None:
        try:
            async for i, out in stream:
                on_output(i, out)
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from e
        finally:
            await stream.aclose()

    await until_disconnected(http, run())


async def first_output(http: HTTPRequest, stream: AsyncIterator[T]) -> Optional[T]:
    """Streaming: wait for the first delta before the 200 goes out, so that an engine error (a rejected
    prompt, a full queue) can still be an HTTP error. None when the stream ends at once."""
    try:
        return await until_disconnected(http, anext(stream))
    except StopAsyncIteration:
        return None
    except Exception as e:
        await stream.aclose()
        raise engine_error(e) from e


async def sse_events(head: Iterable[str], first, stream, render: Callable[[Any], Iterable[str]],
                     final: Optional[Callable[[], str]]) -> AsyncIterator[str]:
    """The SSE body of a streaming endpoint: the `head` events, `render(item)` for every merged output (`first`
    already awaited, then the rest of `stream`), `final()` (the usage chunk) if given, then [DONE]. An error
    met after the 200 was sent is reported in-band; the stream is closed in every case."""
    try:
        for event in head:
            yield event
        item = first
        while item is not None:
            for event in render(item):
                yield event
            item = await anext(stream, None)
        if final is not None:
            yield final()
    except Exception as e:  # noqa: BLE001 - the status is sent already: report in-band
        yield sse_error(e)
    finally:
        await stream.aclose()
    yield SSE_DONE


def sse_error(e: Exception) -> str:
    """An error met after a stream's 200 was sent: reported in-band, as an SSE event with OpenAI's error body."""
    err = engine_error(e)
    return sse({"error": {"message": err.message, "type": "server_error", "param": err.param, "code": err.code}})


def engine_error(e: Exception, param: Optional[str] = "prompt") -> OpenAIError:
    """Errors from AsyncLLM.generate as HTTP errors."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, QueueFullError):
        return OpenAIError(f"The server is busy: {e}. Retry later.", 429, code="queue_full",
                           headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return OpenAIError(str(e), 503, code="engine_dead")
    if isinstance(e, ValueError):
        if isinstance(e, RequestIdInUseError):  # the client's X-Request-Id is the id of a request in flight
            return OpenAIError(f"{REQUEST_ID_HEADER}: {e}", 400, param=REQUEST_ID_HEADER)
        return from_value_error(e) if str(e).split(" ", 1)[0] != "request" else OpenAIError(str(e), 400, param=param)
    return OpenAIError(f"internal error: {e!r}", 500)
