"""The synchronous engine: schedule -> execute -> update, with the front end's output processing."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Optional, Union

from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.engine.core_output import EngineCoreOutput
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.loader.model_loader import load_model
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = Union[str, dict, list[int]]


class LLMEngine:
    """Owns the model runner, the KV-cache manager and the scheduler; `step()` runs one batch."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.loaded = load_model(config.model_config)
        self.tokenizer = self.loaded.tokenizer
        self.runner = ModelRunner(self.loaded, config.cache_config)
        block_size = config.cache_config.block_size
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, block_size,
                                               config.cache_config.enable_prefix_caching)
        max_model_len = self._fit_max_model_len(self.runner.num_blocks * block_size)
        scheduler_config = dataclasses.replace(config.scheduler_config, max_model_len=max_model_len)
        if not scheduler_config.enable_chunked_prefill and scheduler_config.max_num_batched_tokens < max_model_len:
            # Without chunking a whole sequence (a prompt, or one resumed after preemption) must fit one step.
            raise ValueError(f"max_num_batched_tokens={scheduler_config.max_num_batched_tokens} is smaller than "
                             f"max_model_len={max_model_len}; with chunked prefill off it must be at least that")
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB); max_model_len=%d",
                    self.runner.num_blocks, block_size, self.runner.num_blocks * block_size,
                    self.runner.num_blocks * self.runner.bytes_per_block / 2**20, max_model_len)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(**kwargs))

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def _fit_max_model_len(self, cache_tokens: int) -> int:
        """A sequence of max_model_len tokens must fit the whole cache alone, or it could never finish."""
        wanted = self.loaded.max_model_len
        if wanted <= cache_tokens:
            return wanted
        if self.config.model_config.max_model_len is not None:
            raise ValueError(f"max_model_len={wanted} needs more KV cache than there is ({cache_tokens} tokens); "
                             "raise kv_cache_memory_bytes or lower max_model_len")
        logger.warning("max_model_len lowered from %d to %d tokens to fit the KV cache", wanted, cache_tokens)
        return cache_tokens

    # -- requests ----------------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """A prompt is text, vLLM's {"prompt_token_ids": [...]} (or {"prompt": text}) or a list of ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (the engine was started with skip_tokenizer_init)")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}: expected str, dict or list of ids")

    def _check_token_params(self, params: SamplingParams) -> None:
        """Token ids inside the params must exist in the vocabulary (the sampler indexes logits with them)."""
        vocab = self.loaded.hf_config.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    def _check_token_ids(self, ids) -> list[int]:
        vocab = self.loaded.hf_config.vocab_size
        ids = list(ids)
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return ids

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    stream: bool = False, arrival_time: Optional[float] = None,
                    cache_salt: Optional[str] = None) -> None:
        """Queue a prompt. n > 1 becomes n child requests whose outputs come back together.

        `cache_salt` (vLLM's name; also read from a prompt dict's "cache_salt") isolates prefix caching:
        requests only share cached blocks with requests of the same salt.
        Raises ValueError (and queues nothing) when the prompt can never fit.
        """
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        params = params or SamplingParams()
        self._check_token_params(params)
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        arrival_time = time.time() if arrival_time is None else arrival_time
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        children = [Request(child_id, token_ids, params if params.n == 1 else params.child(i),
                            self.loaded.eos_token_ids, arrival_time=arrival_time, cache_salt=cache_salt)
                    for i, child_id in enumerate(child_ids)]
        added = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child.request_id)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.output_processor.add_request(request_id, text, token_ids, params, child_ids, stream, arrival_time)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefix blocks (e.g. between benchmark runs); False while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        """Stop requests now (unknown or finished ids are ignored); their KV blocks are freed at once."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            children = self.output_processor.child_ids(request_id)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step ----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs that are ready (finished requests, and streamed deltas)."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        core_outputs = [
            EngineCoreOutput(r.request_id, r.all_token_ids[-1], r.status.finish_reason, r.stop_reason,
                             runner_output.logprobs.get(r.request_id), r.num_preemptions, r.num_cached_tokens)
            for r in updated
        ]
        outputs, stopped = self.output_processor.process(core_outputs)
        for child_id, stop_string in stopped:
            self.scheduler.finish_requests([child_id], RequestStatus.FINISHED_STOPPED, stop_reason=stop_string)
        return outputs
