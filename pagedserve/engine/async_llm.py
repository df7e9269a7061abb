"""AsyncLLM: one engine thread owns the LLMEngine; asyncio code talks to it through a command queue.

    event loop(s)                          engine thread
    generate() --("add", id, ...)-->  command queue  --> engine.add_request / abort_request
    per-request asyncio.Queue  <--call_soon_threadsafe--  engine.step() outputs (deltas)

The engine thread sleeps on the command queue while there is nothing to run, and otherwise alternates
"apply every pending command" and "one step". After each step it publishes an `EngineStats` snapshot and
hands the step's `IterationStats` to the stat loggers (called on the engine thread; they must be thread-safe,
as prometheus-client metrics are).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.metrics.stats import EngineStats, IterationStats, StatsTracker
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

StatLogger = Callable[[EngineStats, IterationStats], None]


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or crashed); no request can run."""


class QueueFullError(RuntimeError):
    """More requests are waiting to be scheduled than max_num_queued_requests allows."""


@dataclass
class _Target:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass


class AsyncLLM:
    def __init__(self, engine: LLMEngine, max_num_queued_requests: Optional[int] = None,
                 stat_loggers: Optional[list[StatLogger]] = None) -> None:
        if max_num_queued_requests is not None and max_num_queued_requests < 0:
            raise ValueError(f"max_num_queued_requests must be >= 0, got {max_num_queued_requests}")
        self.engine = engine
        self.max_num_queued_requests = max_num_queued_requests
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._targets: dict[str, _Target] = {}  # engine thread only
        self._tracker = StatsTracker()  # engine thread only
        self._error: Optional[BaseException] = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_kwargs(cls, max_num_queued_requests: Optional[int] = None, **engine_kwargs) -> "AsyncLLM":
        return cls(LLMEngine.from_kwargs(**engine_kwargs), max_num_queued_requests)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # -- the asyncio side ----------------------------------------------------------------------------------

    async def generate(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as deltas (new text and tokens since the last one); the last has
        finished=True. Raises ValueError when the engine rejects the request, QueueFullError, or
        EngineDeadError. If the consumer stops early (break, aclose, cancellation: a client disconnect), the
        request is aborted and its KV blocks freed."""
        if not self.is_alive():
            raise EngineDeadError("the engine is not running") from self._error
        request_id = request_id or uuid.uuid4().hex
        target = _Target(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(("add", request_id, prompt, params or SamplingParams(), target, time.time()))
        finished = False
        try:
            while True:
                item = await target.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored)."""
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: Optional[float] = 10.0) -> None:
        """Abort everything still running, stop the engine thread and wait for it."""
        if self._thread.is_alive():
            self._commands.put(("shutdown",))
            self._thread.join(timeout)
        self._stopping = True

    # -- the engine thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                commands = [] if busy else [self._commands.get()]  # idle: sleep until there is work
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if command[0] == "shutdown":
                        self._abort_all(EngineDeadError("the engine was shut down"))
                        return
                    self._apply(command)
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                # Stats first, so that a client that has its last output also sees it counted.
                self._publish(self._tracker.record(outputs))
                for output in outputs:
                    target = self._targets.get(output.request_id)
                    if output.finished:
                        self._targets.pop(output.request_id, None)
                    if target is not None:
                        target.put(output)
        except BaseException as e:  # noqa: BLE001 - anything that kills the loop is reported to every waiter
            logger.exception("engine loop died")
            self._error = e
            dead = EngineDeadError(f"the engine loop died: {e!r}")
            for target in self._targets.values():
                target.put(dead)
            self._targets.clear()
        finally:
            self._stopping = True
            self.stats = EngineStats()

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            request_id = command[1]
            if self._targets.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)
                self._tracker.drop(request_id)
            return
        _, request_id, prompt, params, target, arrival_time = command
        queued = self.engine.scheduler.num_waiting
        if self.max_num_queued_requests is not None and queued + params.n > self.max_num_queued_requests:
            target.put(QueueFullError(f"{queued} requests are waiting to be scheduled; the limit is "
                                      f"max_num_queued_requests={self.max_num_queued_requests}"))
            return
        if request_id in self._targets:
            target.put(ValueError(f"request id {request_id!r} is already in use"))
            return
        try:
            self.engine.add_request(request_id, prompt, params, stream=True, arrival_time=arrival_time)
        except ValueError as e:
            target.put(e)
            return
        self._targets[request_id] = target
        state = self.engine.output_processor.requests[request_id]
        first_child = self.engine.scheduler.requests.get(next(iter(state.children)))
        self._tracker.add(request_id, arrival_time, len(state.prompt_token_ids), first_child)

    def _abort_all(self, error: BaseException) -> None:
        for request_id, target in list(self._targets.items()):
            self.engine.abort_request(request_id)
            self._tracker.drop(request_id)
            target.put(error)
        self._targets.clear()

    def _publish(self, iteration: IterationStats) -> None:
        scheduler, kv = self.engine.scheduler, self.engine.kv_cache_manager
        self.stats = EngineStats(scheduler.num_running, scheduler.num_waiting, kv.usage(),
                                 scheduler.num_preemptions_total, kv.prefix_cache_queries, kv.prefix_cache_hits)
        for stat_logger in self.stat_loggers:
            try:
                stat_logger(self.stats, iteration)
            except Exception:  # noqa: BLE001 - metrics must never take the engine down
                logger.exception("stat logger failed")
