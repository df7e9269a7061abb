"""EngineCore: the inner loop that both front ends drive. Requests (token ids) in, new token ids out.

It owns the model runner, the KV-cache manager and the scheduler, and knows nothing of text, tokenizers or
clients. `LLMEngine` calls it in-process; the server runs it in a process of its own (`core_proc.py`) so that
HTTP, SSE and detokenization never compete with the step loop for the GIL.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Optional

from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.engine.core_output import CoreInfo, EngineCoreOutput, QueueFullError
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.loader.model_loader import LoadedModel, load_model
from pagedserve.metrics.stats import EngineStats

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: Optional[LoadedModel] = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model_config)
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
        self.info = CoreInfo(max_model_len, self.loaded.hf_config.vocab_size, self.loaded.eos_token_ids,
                             self.runner.num_blocks, block_size, self.runner.bytes_per_block)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB); max_model_len=%d",
                    self.runner.num_blocks, block_size, self.runner.num_blocks * block_size,
                    self.runner.num_blocks * self.runner.bytes_per_block / 2**20, max_model_len)

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

    def add_requests(self, children: list[Request], max_num_waiting: Optional[int] = None) -> None:
        """Queue the children of one request, all or none. Raises ValueError when one can never run, and
        QueueFullError when `max_num_waiting` would be exceeded."""
        waiting = self.scheduler.num_waiting
        if max_num_waiting is not None and waiting + len(children) > max_num_waiting:
            raise QueueFullError(f"{waiting} requests are waiting to be scheduled; the limit is "
                                 f"max_num_queued_requests={max_num_waiting}")
        added = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child.request_id)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                        stop_reason: Optional[str] = None) -> None:
        """Finish requests now (abort, or a stop string the front end saw); unknown ids are ignored."""
        self.scheduler.finish_requests(request_ids, status, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # -- the step ----------------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the batch, and return one output per request that got a token."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        logprobs = runner_output.logprobs
        return [EngineCoreOutput(r.request_id, r.all_token_ids[-1], r.status.finish_reason, r.stop_reason,
                                 logprobs.get(r.request_id), r.num_preemptions, r.num_cached_tokens,
                                 r.first_scheduled_time if r.num_output_tokens == 1 else None)
                for r in updated]

    def stats(self) -> EngineStats:
        scheduler, kv = self.scheduler, self.kv_cache_manager
        return EngineStats(scheduler.num_running, scheduler.num_waiting, kv.usage(), scheduler.num_preemptions_total,
                           kv.prefix_cache_queries, kv.prefix_cache_hits, len(kv.req_to_blocks),
                           kv.num_free_blocks, kv.num_blocks)
