"""EngineCore: the inner loop that both front ends drive. Requests (token ids) in, new token ids out.

It owns the model runner, the KV-cache manager and the scheduler, and knows nothing of text, tokenizers or
clients. `LLMEngine` calls it in-process; the server runs it in a process of its own (`core_proc.py`) so that
HTTP, SSE and detokenization never compete with the step loop for the GIL.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Iterable, Optional

from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import SchedulerOutput
from pagedserve.engine.core_output import CoreInfo, EngineCoreOutput, QueueFullError
from pagedserve.engine.step_log import StepLog
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.loader.model_loader import LoadedModel, load_model
from pagedserve.lora.manager import LoRAManager
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.targets import lora_shapes
from pagedserve.metrics.stats import EngineStats
from pagedserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


KV_COMMIT_STEP_BYTES = 4 << 20
"""KV-cache memory committed per idle pass (commit_kv_memory): under 10 ms on the slowest VM seen (2.2 s per
GiB), so that a request arriving meanwhile waits little."""


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: Optional[LoadedModel] = None,
                 kv_commit_at_start: Optional[int] = None) -> None:
        """`kv_commit_at_start`: bytes of the CPU KV cache whose memory is committed before this returns (the
        first blocks the pool hands out), the rest by commit_kv_memory() while idle; None: all of it now."""
        self.config = config
        self.loaded = loaded or load_model(config.model_config)
        lora_config = config.lora_config
        self.lora_manager: Optional[LoRAManager] = None
        if lora_config.enable_lora:
            self.lora_manager = LoRAManager(lora_config, lora_shapes(self.loaded.model), self.loaded.dtype)
        self.runner = ModelRunner(self.loaded, config.cache_config, self.lora_manager)
        self._commit_kv_at_start(kv_commit_at_start)
        block_size = config.cache_config.block_size
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, block_size,
                                               config.cache_config.enable_prefix_caching)
        max_model_len = self._fit_max_model_len(self.runner.num_blocks * block_size)
        scheduler_config = dataclasses.replace(config.scheduler_config, max_model_len=max_model_len)
        if not scheduler_config.enable_chunked_prefill and scheduler_config.max_num_batched_tokens < max_model_len:
            # Without chunking a whole sequence (a prompt, or one resumed after preemption) must fit one step.
            raise ValueError(f"max_num_batched_tokens={scheduler_config.max_num_batched_tokens} is smaller than "
                             f"max_model_len={max_model_len}; with chunked prefill off it must be at least that")
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager,
                                   max_loras=lora_config.max_loras if lora_config.enable_lora else 0)
        self._structured_output: Optional[StructuredOutputManager] = None  # made on the first constrained request
        self._rejected: list[tuple[str, ValueError]] = []
        self._compiling: list[Request] = []  # admitted requests whose grammar is not compiled yet
        self._step_log = StepLog.from_env()
        self.info = CoreInfo(max_model_len, self.loaded.hf_config.vocab_size, self.loaded.eos_token_ids,
                             self.runner.num_blocks, block_size, self.runner.bytes_per_block,
                             config.cache_config.kv_cache_dtype)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB), %s elements (%d bytes per token); "
                    "max_model_len=%d", self.runner.num_blocks, block_size, self.runner.num_blocks * block_size,
                    self.runner.num_blocks * self.runner.bytes_per_block / 2**20,
                    str(self.runner.kv_cache_dtype).removeprefix("torch."),
                    self.runner.bytes_per_block // block_size, max_model_len)

    def _commit_kv_at_start(self, num_bytes: Optional[int]) -> None:
        committer = self.runner.kv_commit
        if committer is None:
            return
        start = time.perf_counter()
        if num_bytes is None:
            committed = committer.commit_all()
        else:
            committed = committer.commit_bytes(num_bytes)
            committer.check_rest_fits()
        logger.info("KV cache memory: %.0f of %.0f MiB committed in %.1f s%s", committed / 2**20,
                    committer.num_blocks * committer.bytes_per_block / 2**20, time.perf_counter() - start,
                    "" if committer.done else "; the rest is committed while the engine is idle")

    def commit_kv_memory(self, num_bytes: int = KV_COMMIT_STEP_BYTES) -> bool:
        """Commit about num_bytes more of the KV cache's memory (call it when idle); False when all of it is
        committed already (nothing was done)."""
        committer = self.runner.kv_commit
        if committer is None or committer.done:
            return False
        committer.commit_bytes(num_bytes)
        if committer.done:
            logger.debug("KV cache memory: all %.0f MiB committed", committer.committed_bytes / 2**20)
        return True

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
        """Queue the children of one request, all or none. Raises ValueError when one can never run (its
        LoRA adapter, loaded here when it is not yet, cannot be served included), and QueueFullError when
        `max_num_waiting` would be exceeded."""
        waiting = self.scheduler.num_waiting
        if max_num_waiting is not None and waiting + len(children) > max_num_waiting:
            raise QueueFullError(f"{waiting} requests are waiting to be scheduled; the limit is "
                                 f"max_num_queued_requests={max_num_waiting}")
        added = []
        try:
            for child in children:
                self._bind_lora(child)
                self.scheduler.add_request(child)
                added.append(child.request_id)
                self._bind_structured_output(child)  # once queued: a refused add leaves no compile behind
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                        stop_reason: Optional[str] = None) -> None:
        """Finish requests now (abort, or a stop string the front end saw); unknown ids are ignored."""
        self.scheduler.finish_requests(request_ids, status, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- LoRA adapters -----------------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter now: True when it was loaded, False when it already was. ValueError
        when it cannot be served (naming it and why), when its name or id is another loaded adapter's, or
        when LoRA is off."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"add_lora takes a LoRARequest, got {type(lora_request).__name__}")
        return self._lora_manager_or_raise().add(lora_request, self._loras_in_use())

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload the adapter with this id: True when it was loaded, False when it was not. An adapter that
        queued or running requests use is not removed: that is a ValueError (abort them or let them finish
        first), so no request ever changes weights half-way. A later request naming the adapter loads it
        again, from its path, as a new load that shares no prefix-cache blocks with the old one."""
        if self.lora_manager is None:
            return False
        removed = self.lora_manager.remove(lora_int_id, self._loras_in_use())
        if removed is not None:
            self.scheduler.lora_slots.forget(removed.generation)
        return removed is not None

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded now (least recently used first)."""
        return [] if self.lora_manager is None else self.lora_manager.list()

    def _lora_manager_or_raise(self) -> LoRAManager:
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need the engine started with enable_lora=True (--enable-lora)")
        return self.lora_manager

    def _bind_lora(self, request: Request) -> None:
        """Tie a request to the current load of its adapter, loading it first when needed. A request naming
        a loaded adapter's name (or id) with another id (or name or path) reloads it when no request uses the
        old one, and is refused (ValueError) while one does."""
        if request.lora_request is None:
            return
        adapter = self._lora_manager_or_raise().get_or_load(request.lora_request, self._loras_in_use())
        request.lora_generation = adapter.generation

    def _bind_structured_output(self, request: Request) -> None:
        """Start compiling the request's constraint (if any); the scheduler passes it over until compiled."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if self._structured_output is None:
            self._structured_output = StructuredOutputManager(self.config.structured_outputs_config,
                                                              self._tokenizer, self.info.vocab_size,
                                                              self.loaded.eos_token_ids)
        request.structured_output = self._structured_output.submit(params)
        self._compiling.append(request)

    def _tokenizer(self):
        """The model's tokenizer for the grammar compiler. Under a server the core loads none (the front end
        tokenizes; it also refuses constraints when the user turned the tokenizer off), so it is loaded here,
        on the compile thread, the first time a constraint needs it."""
        if self.loaded.tokenizer is not None:
            return self.loaded.tokenizer
        from pagedserve.loader.model_loader import load_tokenizer

        return load_tokenizer(dataclasses.replace(self.config.model_config, skip_tokenizer_init=False))

    def take_rejected(self) -> list[tuple[str, ValueError]]:
        """(child request id, why) for queued requests the core gave up on since the last call (a constraint
        that failed to compile or took too long); they are finished, holding nothing."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def _loras_in_use(self) -> set[int]:
        """The adapter loads that queued or running requests hold (never evicted or removed)."""
        return {r.lora_generation for r in self.scheduler.requests.values() if r.lora_generation is not None}

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # -- the step ----------------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the batch, and return one output per request that got a token."""
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if self._step_log is None:
            return self._run(scheduler_output)
        prefill_tokens = StepLog.prefill_tokens(scheduler_output)
        outputs = self._run(scheduler_output)
        self._step_log.record(start, time.perf_counter(), scheduler_output, prefill_tokens)
        return outputs

    def _run(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        grammars = self._structured_output
        if grammars is not None:
            scheduler_output.grammar_bitmask = grammars.bitmask(
                [item.request for item in scheduler_output.scheduled if item.samples])
        runner_output = self.runner.execute(scheduler_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        if grammars is not None:
            self._advance_matchers(updated)
            self._check_compiling(idle=scheduler_output.is_empty)
        logprobs = runner_output.logprobs
        return [EngineCoreOutput(r.request_id, r.all_token_ids[-1], r.status.finish_reason, r.stop_reason,
                                 logprobs.get(r.request_id), r.num_preemptions, r.num_cached_tokens,
                                 r.first_scheduled_time if r.num_output_tokens == 1 else None)
                for r in updated]

    def _advance_matchers(self, updated: list[Request]) -> None:
        """Feed each constrained request its new token. A grammar that ends (its stop token accepted) ends the
        request; a token outside the grammar cannot come from a masked row, so it is logged and stops it."""
        for request in updated:
            if request.structured_output is None or request.is_finished:
                continue
            if not self._structured_output.accept(request, request.all_token_ids[-1]):
                logger.error("request %s: token %d is outside its grammar; stopping it", request.request_id,
                             request.all_token_ids[-1])
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
            elif request.structured_output.matcher.is_terminated():
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)

    def _check_compiling(self, idle: bool) -> None:
        """Reject waiting requests whose grammar failed or timed out, and drop queued compilations no waiting
        request needs any more (aborted). When the step ran nothing (everything waits on grammars), sleep until
        a compilation ends rather than spin."""
        # Only the requests still compiling are looked at: the waiting queue is never walked per step.
        compiling = [r for r in self._compiling if not r.is_finished and not r.grammar_ready]
        for request in compiling:
            error = self._structured_output.failure(request.structured_output)
            if error is not None:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
                self._rejected.append((request.request_id, error))
        self._compiling = [r for r in compiling if not r.is_finished]
        pending = [r.structured_output for r in self._compiling]
        self._structured_output.cancel_unused({state.future for state in pending})
        if idle and pending:
            self._structured_output.wait(pending, timeout=0.05)

    def shutdown(self) -> None:
        """Stop the grammar compile thread (queued compilations are dropped); close the step log."""
        if self._structured_output is not None:
            self._structured_output.shutdown()
        if self._step_log is not None:
            self._step_log.close()

    def stats(self) -> EngineStats:
        scheduler, kv = self.scheduler, self.kv_cache_manager
        lora = self.lora_manager is not None
        return EngineStats(scheduler.num_running, scheduler.num_waiting, kv.usage(), scheduler.num_preemptions_total,
                           kv.prefix_cache_queries, kv.prefix_cache_hits, len(kv.req_to_blocks),
                           kv.num_free_blocks, kv.num_blocks, _adapter_names(scheduler.running) if lora else (),
                           _adapter_names(scheduler.waiting) if lora else ())


def _adapter_names(requests) -> tuple[str, ...]:
    """The distinct LoRA adapter names among `requests`, sorted (vLLM's lora_requests_info labels)."""
    return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))
