"""The front end's per-request state: tokens to text, stop strings, n children into one RequestOutput.

One loop over the step's core outputs, nowhere else. Detokenization happens here, off the core: a request
without stop strings that is not streamed is decoded once, when it finishes. A streamed request gets an output
every stream_interval tokens (each child's first token and its finish at once).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from pagedserve.engine.core_output import EngineCoreOutput
from pagedserve.engine.detokenizer import IncrementalDetokenizer, decode_all
from pagedserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.sampling_params import SamplingParams


@dataclass
class _Child:
    index: int
    token_ids: list[int] = field(default_factory=list)
    detokenizer: Optional[IncrementalDetokenizer] = None
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: object = None
    sent_tokens: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    children: dict[str, _Child]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    stream_interval: int = 1

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str], stream: bool, arrival_time: float) -> None:
        incremental = self.tokenizer is not None and (stream or bool(params.stop))
        children = {}
        for index, child_id in enumerate(child_ids):
            child = _Child(index)
            if incremental:
                child.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            if params.logprobs is not None:
                child.logprobs, child.cumulative_logprob = [], 0.0
            children[child_id] = child
            self.child_to_parent[child_id] = request_id
        interval = max(params.stream_interval or 1, self.stream_interval)
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, stream, children,
                                                 RequestMetrics(arrival_time), stream_interval=interval)

    def child_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return list(state.children) if state else []

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for child_id in state.children:
                self.child_to_parent.pop(child_id, None)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Apply one step's core outputs. Returns the RequestOutputs to hand out now, and (child id, stop
        string) for children that hit a stop string: the core must finish those."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        stopped: list[tuple[str, str]] = []
        for out in outputs:
            parent_id = self.child_to_parent.get(out.request_id)
            if parent_id is None:
                continue
            state = self.requests[parent_id]
            child = state.children[out.request_id]
            if child.finish_reason is not None:
                # Stopped here by a stop string while a core in another process already ran its next step.
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.num_preemptions = max(state.metrics.num_preemptions, out.num_preemptions)
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.first_scheduled_time is not None and child.index == 0:
                state.metrics.first_scheduled_time = out.first_scheduled_time
            child.token_ids.append(out.new_token_id)
            if out.logprobs is not None and child.logprobs is not None:
                self._add_logprobs(child, out.logprobs)
            if child.detokenizer is not None:
                stop_string = child.detokenizer.update([out.new_token_id])
                if stop_string is not None:
                    child.finish_reason, child.stop_reason = "stop", stop_string
                    if out.finish_reason is None:
                        stopped.append((out.request_id, stop_string))
            if child.finish_reason is None and out.finish_reason is not None:
                child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
            touched[parent_id] = state
        results = []
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                self.abort_request(state.request_id)
            if state.finished or (state.stream and _stream_due(state)):
                results.append(self._make_output(state))
        return results, stopped

    def _add_logprobs(self, child: _Child, entries: list[tuple[int, float, int]]) -> None:
        position: dict[int, Logprob] = {}
        for token_id, logprob, rank in entries:
            if token_id not in position:
                text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else None
                position[token_id] = Logprob(logprob, rank, text)
        child.logprobs.append(position)
        child.cumulative_logprob += entries[0][1]

    def _make_output(self, state: RequestState) -> RequestOutput:
        completions = []
        for child in state.children.values():
            finished = child.finish_reason is not None
            if state.stream:
                # Delta: the text and tokens that are new since the last output of this child.
                text = child.detokenizer.get_next_output_text(finished, delta=True) if child.detokenizer else ""
                token_ids = child.token_ids[child.sent_tokens:]
                logprobs = child.logprobs[child.sent_tokens:] if child.logprobs is not None else None
                child.sent_tokens = len(child.token_ids)
            else:
                text = self._final_text(state, child)
                token_ids, logprobs = list(child.token_ids), child.logprobs
            completions.append(CompletionOutput(child.index, text, token_ids, child.cumulative_logprob, logprobs,
                                                child.finish_reason, child.stop_reason))
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, state.finished,
                             state.metrics, state.num_cached_tokens)

    def _final_text(self, state: RequestState, child: _Child) -> str:
        if self.tokenizer is None:
            return ""
        if child.detokenizer is not None:
            return child.detokenizer.output_text
        return decode_all(self.tokenizer, child.token_ids, state.params.skip_special_tokens, state.prompt_token_ids)


def _stream_due(state: RequestState) -> bool:
    """Whether a streamed request's next chunk is due: a child has its first token, stream_interval tokens not
    sent yet, or has finished."""
    if state.stream_interval == 1:
        return True
    return any(child.finish_reason is not None or child.sent_tokens == 0
               or len(child.token_ids) - child.sent_tokens >= state.stream_interval
               for child in state.children.values())
