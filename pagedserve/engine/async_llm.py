"""AsyncLLM: the server's front end. The engine core steps in a process of its own; this side tokenizes,
detokenizes and hands each request its outputs.

    event loop(s)                                    engine-core process (core_proc.py)
    generate(): InputProcessor -> ("add", ...)  --->  schedule, step, stop checks on ids
    per-request asyncio.Queue <- OutputProcessor <--- reader thread <--- ("outputs", ids, stats)

The reader thread (core_client.py) runs the OutputProcessor (text, stop strings, n children), publishes the
core's `EngineStats` snapshot, hands the step's `IterationStats` to the stat loggers (called on that thread:
they must be thread-safe, as prometheus-client metrics are), and delivers each delta `RequestOutput` to its
request's queue with `loop.call_soon_threadsafe`. One lock guards the front-end state that both the event
loops (add, abort) and the reader thread touch. If the core process dies, every request in flight gets
EngineDeadError and `is_alive()` turns False.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

from pagedserve.config import EngineConfig
from pagedserve.core.request import RequestIdInUseError
from pagedserve.engine.core_client import EngineCoreClient
from pagedserve.engine.core_output import CoreInfo, QueueFullError
from pagedserve.engine.core_restarter import CoreRestarter
from pagedserve.engine.input_processor import InputProcessor, PromptType
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.metrics.stats import EngineStats, IterationStats, StatsTracker
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

StatLogger = Callable[[EngineStats, IterationStats], None]

__all__ = ["AsyncLLM", "EngineDeadError", "QueueFullError"]


class EngineDeadError(RuntimeError):
    """The engine core has stopped (shut down, crashed or killed); no request can run."""


@dataclass
class _Target:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass


def front_end_input_processor(config: EngineConfig, tokenizer, info: CoreInfo) -> InputProcessor:
    """The InputProcessor of a front end whose core reported `info` (its eos ids join the tokenizer's)."""
    eos = set(info.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return InputProcessor(tokenizer, info.vocab_size, info.max_model_len, frozenset(eos),
                          config.scheduler_config.scheduling_policy, config.lora_config.enable_lora)


class CoreFacts:
    """What a front end reads off its core's CoreInfo (`self.info`): AsyncLLM and distributed.RemoteEngine."""

    info: CoreInfo

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size


class AsyncLLM(CoreFacts):
    def __init__(self, config: EngineConfig, max_num_queued_requests: Optional[int] = None,
                 stat_loggers: Optional[list[StatLogger]] = None, restart_on_failure: bool = False) -> None:
        """`restart_on_failure`: when the engine-core process dies, start a new one (core_restarter.py);
        `restart_listeners` are called with the restart count after each."""
        if max_num_queued_requests is not None and max_num_queued_requests < 0:
            raise ValueError(f"max_num_queued_requests must be >= 0, got {max_num_queued_requests}")
        self.max_num_queued_requests = max_num_queued_requests
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.stats = EngineStats()
        self._lock = threading.Lock()
        self._targets: dict[str, _Target] = {}
        self._tracker = StatsTracker()
        self._shutting_down = False
        self._dead_reason: Optional[str] = None
        # The core loads the model in its process while this one loads the tokenizer.
        self.config = config
        core_config = dataclasses.replace(
            config, model_config=dataclasses.replace(config.model_config, skip_tokenizer_init=True))
        self._core_config = core_config
        self.restart_listeners: list[Callable[[int], None]] = []
        self._restarter = (CoreRestarter(self._start_core, self._adopt_core, self._restarted)
                           if restart_on_failure else None)
        self._client = EngineCoreClient(core_config, self._on_outputs, self._on_dead)
        try:
            from pagedserve.loader.model_loader import load_tokenizer  # imports torch: after the core started

            self.tokenizer = load_tokenizer(config.model_config)
            self.info = self._client.wait_ready()
        except BaseException:
            self._client.shutdown(timeout=5)
            raise
        # Requests are tokenized on the event loop while the reader thread detokenizes: one tokenizer each.
        self.input_processor = front_end_input_processor(config, copy.deepcopy(self.tokenizer), self.info)
        self.output_processor = OutputProcessor(self.tokenizer, config.scheduler_config.stream_interval)

    @classmethod
    def from_kwargs(cls, max_num_queued_requests: Optional[int] = None, restart_on_failure: bool = False,
                    **engine_kwargs) -> "AsyncLLM":
        return cls(EngineConfig.from_kwargs(**engine_kwargs), max_num_queued_requests,
                   restart_on_failure=restart_on_failure)

    @property
    def num_restarts(self) -> int:
        return self._restarter.restarts if self._restarter is not None else 0

    def is_alive(self) -> bool:
        return self._dead_reason is None and not self._shutting_down and self._client.is_alive()

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still in flight on the front end or, as last reported, in the core."""
        return bool(self._targets) or self.stats.num_running + self.stats.num_waiting > 0

    def core_stats(self, timeout: float = 10.0) -> EngineStats:
        """A fresh snapshot from the core, taken after every message sent before this call."""
        return self._client.call("stats", timeout)

    def reset_prefix_cache(self, timeout: float = 10.0) -> bool:
        """Forget the core's prefix cache; False while requests hold blocks."""
        return self._client.call("reset_prefix_cache", timeout)

    def add_lora(self, lora_request, timeout: float = 60.0) -> bool:
        """Load and check a LoRA adapter in the core now (ValueError naming the problem when it cannot be
        served)."""
        return self._client.call("add_lora", timeout, (lora_request,))

    def remove_lora(self, lora_int_id: int, timeout: float = 10.0) -> bool:
        """Unload an adapter (see EngineCore.remove_lora); False when the core does not know it."""
        return self._client.call("remove_lora", timeout, (lora_int_id,))

    def list_loras(self, timeout: float = 10.0) -> list:
        """The LoRARequests of the adapters the core has loaded."""
        return self._client.call("list_loras", timeout)

    # -- the asyncio side ----------------------------------------------------------------------------------

    async def generate(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, priority: int = 0, tenant: Optional[str] = None,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as deltas (new text and tokens since the last one); the last has
        finished=True. `priority` (lower runs first) and `tenant` feed the scheduling policy; `lora_request`
        (a LoRARequest, or None for the base model) picks an adapter. Raises ValueError
        when the request is invalid or rejected, QueueFullError, or EngineDeadError. If the consumer stops early
        (break, aclose, cancellation: a client disconnect), the request is aborted and its KV blocks freed."""
        if not self.is_alive():
            raise EngineDeadError(f"the engine is not running ({self._dead_reason or 'shut down'})")
        request_id = request_id or uuid.uuid4().hex
        target = _Target(asyncio.get_running_loop(), asyncio.Queue())
        self._add(request_id, prompt, params or SamplingParams(), target, priority, tenant, lora_request)
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
                self.abort(request_id)

    def _add(self, request_id: str, prompt: PromptType, params: SamplingParams, target: _Target, priority: int,
             tenant: Optional[str], lora_request) -> None:
        request = self.input_processor.process(request_id, prompt, params, priority=priority, tenant=tenant,
                                               lora_request=lora_request)
        with self._lock:
            if self._dead_reason is not None:  # died since generate() looked: nobody would answer
                raise EngineDeadError(f"the engine is not running ({self._dead_reason})")
            if request_id in self._targets:
                raise RequestIdInUseError(request_id)
            self.output_processor.add_request(request_id, request.prompt, request.prompt_token_ids, request.params,
                                              request.child_ids, True, request.arrival_time)
            self._targets[request_id] = target
            self._tracker.add(request_id, request.arrival_time, len(request.prompt_token_ids))
        self._client.send(("add", request_id, request.children, self.max_num_queued_requests))

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored)."""
        with self._lock:
            if self._targets.pop(request_id, None) is None:
                return
            children = self.output_processor.child_ids(request_id)
            self.output_processor.abort_request(request_id)
            self._tracker.drop(request_id)
        self._client.send(("abort", children))

    def inject_fault(self, fault: str) -> None:
        """Make the engine core fail, to test recovery: "step_error" (its next step raises) or "kill" (its
        process is killed now)."""
        if fault == "kill":
            self._client.process.kill()
        elif fault == "step_error":
            self._client.send(("fault", fault))
        else:
            raise ValueError(f"fault must be step_error or kill, got {fault!r}")

    def shutdown(self, timeout: Optional[float] = 10.0) -> None:
        """Abort everything still running, stop the engine core and wait for it."""
        self._shutting_down = True
        if self._restarter is not None:
            self._restarter.stop()
        with self._lock:
            client = self._client
        client.shutdown(timeout)

    # -- restarts (core_restarter.py) ------------------------------------------------------------------------

    def _start_core(self) -> EngineCoreClient:
        client = EngineCoreClient(self._core_config, self._on_outputs, self._on_dead)
        try:
            client.wait_ready()
        except BaseException:
            client.shutdown(timeout=5)
            raise
        return client

    def _adopt_core(self, client: EngineCoreClient) -> bool:
        with self._lock:
            if not self._shutting_down:
                old, self._client = self._client, client
                self._dead_reason = None
        if self._client is not client:
            client.shutdown(timeout=5)
            return False
        old.shutdown(timeout=1)  # its process is gone: this joins its threads and closes its pipe
        return True

    def _restarted(self, count: int) -> None:
        for listener in self.restart_listeners:
            try:
                listener(count)
            except Exception:  # noqa: BLE001 - metrics must never take the engine down
                logger.exception("restart listener failed")

    # -- the reader thread ---------------------------------------------------------------------------------

    def _on_outputs(self, core_outputs, stats: EngineStats, rejections) -> None:
        deliveries = []
        with self._lock:
            for rejected_id, error in rejections:
                request_id = self.output_processor.child_to_parent.get(rejected_id, rejected_id)
                siblings = [c for c in self.output_processor.child_ids(request_id) if c != rejected_id]
                if siblings:
                    self._client.send(("abort", siblings))
                self.output_processor.abort_request(request_id)
                self._tracker.drop(request_id)
                deliveries.append((self._targets.pop(request_id, None), error))
            outputs, stopped = self.output_processor.process(core_outputs)
            iteration = self._tracker.record(outputs)
            for output in outputs:
                target = self._targets.pop if output.finished else self._targets.get
                deliveries.append((target(output.request_id, None), output))
        for child_id, stop_string in stopped:
            self._client.send(("stop", child_id, stop_string))
        # Stats first, so that a client that has its last output also sees it counted.
        self.stats = stats
        for stat_logger in self.stat_loggers:
            try:
                stat_logger(stats, iteration)
            except Exception:  # noqa: BLE001 - metrics must never take the engine down
                logger.exception("stat logger failed")
        for target, item in deliveries:
            if target is not None:
                target.put(item)

    def _on_dead(self, reason: str) -> None:
        if self._shutting_down:
            error = EngineDeadError("the engine was shut down")
        else:
            logger.error("engine core died: %s", reason)
            error = EngineDeadError(f"the engine core died: {reason}")
        with self._lock:
            self._dead_reason = reason
            targets = list(self._targets.items())
            self._targets.clear()
            for request_id, _ in targets:
                self.output_processor.abort_request(request_id)
                self._tracker.drop(request_id)
        self.stats = EngineStats()
        for _, target in targets:
            target.put(error)
        if self._restarter is not None and not self._shutting_down:
            self._restarter.core_died()
