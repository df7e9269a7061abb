"""The synchronous engine for offline use: the front end (inputs, outputs, text) over an in-process core."""

from __future__ import annotations

import itertools
import logging
from typing import Optional, Union

from pagedserve.config import EngineConfig
from pagedserve.core.request import RequestIdInUseError, RequestStatus
from pagedserve.engine.core import EngineCore
from pagedserve.engine.input_processor import InputProcessor, PromptType
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    """Owns an EngineCore (model runner, KV-cache manager, scheduler) and the front end around it;
    `step()` runs one batch and returns the outputs that are ready."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self.loaded = self.core.loaded
        self.tokenizer = self.loaded.tokenizer
        info = self.core.info
        self.input_processor = InputProcessor(self.tokenizer, info.vocab_size, info.max_model_len,
                                              info.eos_token_ids, config.scheduler_config.scheduling_policy,
                                              config.lora_config.enable_lora)
        self.output_processor = OutputProcessor(self.tokenizer, config.scheduler_config.stream_interval)
        self._ids = itertools.count()
        self._errors: list[ValueError] = []  # for requests the core rejected; raised by the next step()

    @classmethod
    def from_kwargs(cls, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(**kwargs))

    # The core's parts, for tests, benchmarks and tools that look inside.
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv_cache_manager(self):
        return self.core.kv_cache_manager

    @property
    def runner(self):
        return self.core.runner

    @property
    def max_model_len(self) -> int:
        return self.core.info.max_model_len

    # -- requests ----------------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    stream: bool = False, arrival_time: Optional[float] = None,
                    cache_salt: Optional[str] = None, priority: int = 0, tenant: Optional[str] = None,
                    lora_request: Optional[LoRARequest] = None) -> None:
        """Queue a prompt. n > 1 becomes n child requests whose outputs come back together.

        `cache_salt` (vLLM's name; also read from a prompt dict's "cache_salt") isolates prefix caching:
        requests only share cached blocks with requests of the same salt. `priority` (lower runs first) and
        `tenant` matter under the `priority` and `fair` scheduling policies. `lora_request` runs the request
        with that LoRA adapter (engine started with enable_lora; loaded on first use).
        Raises ValueError (and queues nothing) when the prompt can never fit or the adapter cannot be served.
        """
        if request_id in self.output_processor.requests:
            raise RequestIdInUseError(request_id)
        request = self.input_processor.process(request_id, prompt, params, arrival_time, cache_salt, priority,
                                               tenant, lora_request)
        self.core.add_requests(request.children)
        self.output_processor.add_request(request_id, request.prompt, request.prompt_token_ids, request.params,
                                          request.child_ids, stream, request.arrival_time)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter now (see EngineCore.add_lora)."""
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; ValueError while requests use it (see EngineCore.remove_lora)."""
        return self.core.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded now."""
        return self.core.list_loras()

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefix blocks (e.g. between benchmark runs); False while requests hold blocks."""
        return self.core.reset_prefix_cache()

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        """Stop requests now (unknown or finished ids are ignored); their KV blocks are freed at once."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.core.finish_requests(self.output_processor.child_ids(request_id))
            self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while requests run or an error for a rejected one is still to be raised by step()."""
        return self.core.has_unfinished_requests() or bool(self._errors)

    # -- the step ----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs that are ready (finished requests, and streamed deltas). A request
        the core gave up on while it was queued (its constraint failed to compile or timed out) is aborted and
        its ValueError raised by the next call, after this one has returned the other requests' outputs."""
        if self._errors:
            raise self._errors.pop(0)
        outputs, stopped = self.output_processor.process(self.core.step())
        for child_id, stop_string in stopped:
            self.core.finish_requests([child_id], RequestStatus.FINISHED_STOPPED, stop_reason=stop_string)
        for child_id, error in self.core.take_rejected():  # queued requests the core gave up on (their grammar)
            self.abort_request(self.output_processor.child_to_parent.get(child_id, child_id))
            self._errors.append(error)
        return outputs
