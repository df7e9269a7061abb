"""The engine core's side of structured output: compile each constraint off the step loop, keep one matcher
per sequence, fill the step's token bitmask, advance the matchers with the sampled tokens.

A request with a constraint waits (skipped by the scheduler, not blocking the requests behind it) until its
grammar is compiled: vLLM's WAITING_FOR_FSM. Compilations run on one background thread, cached by the
constraint (the same schema from many requests compiles once); a request whose compilation fails, or takes
longer than the configured limit, is rejected with a ValueError naming the problem.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import OrderedDict
from typing import Callable, Optional

import torch

from pagedserve.config import StructuredOutputsConfig
from pagedserve.structured_output.grammar import GrammarCompiler, new_matcher
from pagedserve.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


class StructuredOutputRequest:
    """One sequence's constraint: its grammar (compiling until `ready`) and, once compiled, its matcher."""

    def __init__(self, params: StructuredOutputsParams, future: concurrent.futures.Future, submitted: float) -> None:
        self.params = params
        self.future = future
        self.submitted = submitted
        self.matcher = None

    @property
    def ready(self) -> bool:
        """Compiled (a failed compilation is never ready: the core rejects the request)."""
        if self.matcher is None and self.future.done() and self.future.exception() is None:
            self.matcher = new_matcher(self.future.result())
        return self.matcher is not None


class GrammarBitmask:
    """The allowed next tokens of a step's constrained rows: `rows` maps request id -> row of `bitmask`
    ([rows, ceil(vocab / 32)] int32, a bit per token, as xgrammar lays it out)."""

    def __init__(self, rows: dict[str, int], bitmask: torch.Tensor) -> None:
        self.rows, self.bitmask = rows, bitmask


class StructuredOutputManager:
    def __init__(self, config: StructuredOutputsConfig, tokenizer: Callable[[], object], vocab_size: int,
                 stop_token_ids, clock: Callable[[], float] = time.monotonic) -> None:
        """`tokenizer()` returns the model's tokenizer (called once, on the compile thread)."""
        self.config = config
        self.vocab_size = vocab_size
        self._clock = clock
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-grammar")
        # The tokenizer's tables (~0.2 s for a 49k vocabulary) are built on the compile thread, first use.
        self._compiler = self._executor.submit(lambda: GrammarCompiler(tokenizer(), vocab_size, stop_token_ids))
        self._grammars: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()

    def submit(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Start (or reuse) the constraint's compilation; the request waits on the returned state."""
        key = params.key()
        future = self._grammars.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._executor.submit(self._compile, params)
            self._grammars[key] = future
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(key)
        return StructuredOutputRequest(params, future, self._clock())

    def _compile(self, params: StructuredOutputsParams):
        start = time.perf_counter()
        compiled = self._compiler.result().compile(params)
        logger.debug("compiled structured_outputs.%s in %.1f ms", params.kind, 1e3 * (time.perf_counter() - start))
        return compiled

    def cancel_unused(self, in_use: set) -> int:
        """Cancel the queued (not yet started) compilations whose future is not in `in_use`: their requests
        were aborted, and they would only delay the compilations behind them. Returns how many."""
        cancelled = [key for key, future in self._grammars.items() if future not in in_use and future.cancel()]
        for key in cancelled:
            del self._grammars[key]
        return len(cancelled)

    def failure(self, state: StructuredOutputRequest) -> Optional[ValueError]:
        """Why a waiting request's grammar will never be ready (failed, or past the time limit), or None."""
        if state.future.done():
            error = state.future.exception()
            return error if isinstance(error, ValueError) or error is None else ValueError(
                f"structured_outputs.{state.params.kind} cannot be compiled: {error!r}")
        limit = self.config.structured_outputs_compile_timeout
        if self._clock() - state.submitted > limit:
            return ValueError(f"structured_outputs.{state.params.kind} took longer than {limit:g} s to compile "
                              "(structured_outputs_compile_timeout)")
        return None

    def wait(self, states: list[StructuredOutputRequest], timeout: float) -> None:
        """Sleep until one of these compilations ends, at most `timeout` s (the core has nothing else to run)."""
        concurrent.futures.wait([s.future for s in states], timeout, concurrent.futures.FIRST_COMPLETED)

    def bitmask(self, requests: list) -> Optional[GrammarBitmask]:
        """The bitmask of the requests that sample under a constraint this step (None when there are none).
        A matcher whose grammar is complete allows only the stop tokens."""
        constrained = [r for r in requests if r.structured_output is not None]
        if not constrained:
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(constrained), self.vocab_size)
        for row, request in enumerate(constrained):
            request.structured_output.matcher.fill_next_token_bitmask(bitmask, row)
        return GrammarBitmask({r.request_id: row for row, r in enumerate(constrained)}, bitmask)

    def accept(self, request, token_id: int) -> bool:
        """Advance the request's matcher by its new token; False when the grammar does not allow it."""
        return request.structured_output.matcher.accept_token(token_id)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
