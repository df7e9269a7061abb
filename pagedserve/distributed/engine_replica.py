"""EngineReplica: the engine deployment's class. Each replica runs one AsyncLLM (its engine core in a process of
its own, as under `pagedserve serve`), streams the outputs of the requests routed to it, and reports its
metrics to the ReplicaBoard."""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from ray import serve

from pagedserve.distributed.replica_board import REPORT_PERIOD_S
from pagedserve.distributed.replica_error import ReplicaError
from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from pagedserve.entrypoints.openai.lora_modules import LoRAModules
from pagedserve.logging_utils import LoggingConfig, configure_logging
from pagedserve.metrics.prometheus import PrometheusStatLogger

logger = logging.getLogger(__name__)


class EngineReplica:
    def __init__(self, engine_kwargs: dict, max_num_queued_requests: Optional[int], model_name: str, board,
                 lora_modules: Optional[list] = None, logging_config: Optional[LoggingConfig] = None) -> None:
        # Before the engine starts: its core process logs as this one does (current_logging()).
        configure_logging(logging_config or LoggingConfig(), process_name="engine replica")
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.async_llm = AsyncLLM.from_kwargs(max_num_queued_requests=max_num_queued_requests, **engine_kwargs)
        lora = self.async_llm.config.lora_config
        # Every replica loads the same adapters in the same order: the same ids as the ingress gives them.
        self.loras = LoRAModules(self.async_llm, [model_name], lora.enable_lora)
        self.loras.load_at_start(list(lora_modules or []))
        self.metrics_logger = PrometheusStatLogger(model_name, max_loras=lora.max_loras if lora.enable_lora else None)
        self.metrics_logger.log_cache_config(self.async_llm.info)
        self.async_llm.stat_loggers.append(self.metrics_logger)
        self._board = board
        self._reporter = asyncio.get_event_loop().create_task(self._report_forever())
        logger.info("engine replica %s ready", self.replica_id)

    def info(self):
        """The CoreInfo of this replica's core (every replica has the same model and cache settings)."""
        return self.async_llm.info

    def lora_requests(self) -> list:
        """The LoRARequests of the adapters this replica loaded at start."""
        return [self.loras.get(name) for name in self.loras.names]

    async def generate(self, prompt, params, request_id: str, priority: int = 0, tenant: Optional[str] = None,
                       lora_request=None, routing=None, avoid=None, call_id=None):
        """AsyncLLM.generate's deltas; the first names this replica. A refusal or an engine failure arrives
        as a ReplicaError item (the last). `routing`, `avoid` and `call_id` are the router's, unused here."""
        if not self.async_llm.is_alive():  # dead before this request came: another replica may run it
            yield ReplicaError("unavailable", "this replica's engine is not running", self.replica_id)
            return
        first = True
        try:
            async for output in self.async_llm.generate(prompt, params, request_id, priority=priority,
                                                        tenant=tenant, lora_request=lora_request):
                if first:
                    output.replica, first = self.replica_id, False
                yield output
        except (ValueError, QueueFullError, EngineDeadError) as e:
            yield ReplicaError.of(e, self.replica_id)

    def metrics(self) -> tuple[str, str]:
        """(this replica's id, its metrics text now): what the ingress's broadcast collects."""
        return self.replica_id, self.metrics_logger.render().decode()

    async def reset_prefix_cache(self) -> bool:
        return await asyncio.to_thread(self.async_llm.reset_prefix_cache)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine core died is restarted."""
        if not self.async_llm.is_alive():
            raise RuntimeError("the engine core of this replica is not running")

    async def _report_forever(self) -> None:
        while True:
            try:
                await self._board.report.remote(self.replica_id, self.metrics_logger.render().decode())
            except Exception:  # noqa: BLE001 - the board restarting must not stop the engine
                logger.warning("could not report to the replica board", exc_info=True)
            await asyncio.sleep(REPORT_PERIOD_S)

    def __del__(self) -> None:
        # Ray Serve calls this at shutdown, once the replica's requests have drained.
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.cancel()
            try:
                self._board.leave.remote(self.replica_id)  # off /health and /metrics now, not 5 s later
            except Exception:  # noqa: BLE001 - Serve shutting down around us: the engine must still stop
                pass
        if getattr(self, "async_llm", None) is not None:
            self.async_llm.shutdown()
