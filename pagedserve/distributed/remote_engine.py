"""RemoteEngine: the ingress's engine. It has the face of AsyncLLM that the server's routes use (generate,
input_processor, max_model_len, is_alive, reset_prefix_cache, ...), so the ingress is the single server's app
unchanged; behind it, every request is a streaming call to the engine deployment.

A request is checked here first (the InputProcessor of the replicas' model: a bad request never leaves the
ingress), then sent with its routing hashes for the router. When the replica dies before the request has
produced anything, it is sent again (the router has dropped the dead replica); once output has reached the
client, the stream ends with EngineDeadError, which the routes turn into an error event.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import AsyncIterator, Optional

from ray.exceptions import ActorUnavailableError, RayActorError

from pagedserve.config import EngineConfig
from pagedserve.distributed.prefix_index import routing_hashes
from pagedserve.distributed.replica_board import REPORT_PERIOD_S
from pagedserve.distributed.replica_error import ReplicaError
from pagedserve.engine.async_llm import CoreFacts, EngineDeadError, front_end_input_processor
from pagedserve.engine.core_output import CoreInfo
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REPLICA_GONE = (RayActorError, ActorUnavailableError)
MAX_ATTEMPTS = 3


class RemoteEngine(CoreFacts):
    def __init__(self, engine, board, config: EngineConfig, info: CoreInfo) -> None:
        from pagedserve.loader.model_loader import load_tokenizer

        self._engine, self._board = engine, board
        self._streaming = engine.options(stream=True)
        self.config, self.info = config, info
        self.tokenizer = load_tokenizer(config.model_config)
        self.input_processor = front_end_input_processor(config, self.tokenizer, info)
        self.stat_loggers: list = []  # the replicas log their engines' stats; nothing steps here
        self.replicas: dict[str, str] = {}
        """Replica id -> its last metrics text, from the board (refreshed by `watch`)."""
        self._watcher: Optional[asyncio.Task] = None
        self.replica_loras: list = []
        """The adapters every replica loads at start (--lora-modules), as LoRARequests."""

    @classmethod
    async def connect(cls, engine, board, config: EngineConfig) -> "RemoteEngine":
        """Ask a replica what the core looks like, then build the front end for it."""
        info = await engine.info.remote()
        remote = cls(engine, board, config, info)
        remote.replica_loras = await engine.lora_requests.remote()
        await remote.refresh()
        return remote

    def is_alive(self) -> bool:
        """Whether any replica has reported within the board's window."""
        return bool(self.replicas)

    async def refresh(self) -> dict[str, str]:
        self.replicas = await self._board.snapshot.remote()
        return self.replicas

    def start_watching(self) -> None:
        async def watch() -> None:
            while True:
                await asyncio.sleep(REPORT_PERIOD_S)
                try:
                    await self.refresh()
                except Exception:  # noqa: BLE001 - keep the last view until the board answers again
                    logger.warning("could not read the replica board", exc_info=True)

        self._watcher = asyncio.get_running_loop().create_task(watch())

    async def generate(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                       priority: int = 0, tenant: Optional[str] = None,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        """AsyncLLM.generate over the replicas (same arguments, outputs and exceptions)."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        request = self.input_processor.process(request_id, prompt, params, priority=priority, tenant=tenant,
                                               lora_request=lora_request)
        hashes = routing_hashes(request.prompt_token_ids, self.info.block_size,
                                prompt.get("cache_salt") if isinstance(prompt, dict) else None,
                                lora_request.lora_name if lora_request is not None else None)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            started = False
            stream = self._streaming.generate.remote(
                prompt, params, request_id, priority=priority, tenant=tenant, lora_request=lora_request,
                routing=hashes)
            finished = False
            try:
                async for item in stream:
                    if isinstance(item, ReplicaError):
                        finished = True
                        raise item.exception()
                    started, finished = True, item.finished
                    yield item
                return
            except REPLICA_GONE as e:
                finished = True
                if started:
                    raise EngineDeadError(f"the engine replica serving this request died: {e}") from None
                logger.warning("request %s: its replica died before it started (attempt %d of %d)", request_id,
                               attempt, MAX_ATTEMPTS)
            finally:
                if not finished:
                    stream.cancel()  # the client is gone: the replica aborts the request and frees its blocks
        raise EngineDeadError(f"no engine replica could run the request in {MAX_ATTEMPTS} attempts")

    async def replica_metrics(self, timeout: float = 2.0) -> dict[str, str]:
        """Replica id -> its metrics text, asked of each live replica now (its last report if it does not answer
        within `timeout`)."""
        reports = await self.refresh()

        async def ask(replica: str) -> str:
            call = self._engine.metrics.remote(replica=replica)
            try:
                return await asyncio.wait_for(call, timeout)
            except Exception:  # noqa: BLE001 - a replica going away: its report is the best there is
                call.cancel()
                return reports[replica]

        replicas = sorted(reports)
        return dict(zip(replicas, await asyncio.gather(*(ask(r) for r in replicas))))

    def add_lora(self, lora_request, timeout: float = 60.0) -> bool:
        """The ingress's LoRAModules adding a --lora-modules adapter: the replicas loaded it at start, with the same
        id (ValueError for any other adapter: no runtime loading through Ray yet)."""
        for loaded in self.replica_loras:
            if (loaded.lora_name, loaded.lora_int_id, loaded.lora_path) == (
                    lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path):
                return True
        raise ValueError(f"LoRA adapter `{lora_request.lora_name}` is not among the replicas' --lora-modules "
                         "(with --ray, adapters are loaded at start only)")

    def remove_lora(self, lora_int_id: int, timeout: float = 10.0) -> bool:
        raise ValueError("with --ray, adapters stay loaded for the life of the app")

    def reset_prefix_cache(self, timeout: float = 10.0) -> bool:
        """Reset every live replica's prefix cache (called off the event loop); False if any still holds
        blocks for running requests."""
        calls = [self._engine.reset_prefix_cache.remote(replica=r) for r in list(self.replicas)]
        return all([call.result(timeout_s=timeout) for call in calls])

    def shutdown(self, timeout: Optional[float] = None) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
