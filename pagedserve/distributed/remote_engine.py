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
import contextlib
import logging
import uuid
from typing import AsyncIterator, Optional

from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException, RequestCancelledError

from pagedserve.config import EngineConfig
from pagedserve.distributed.prefix_index import routing_hashes
from pagedserve.distributed.replica_board import REPORT_PERIOD_S
from pagedserve.distributed.replica_error import ReplicaError
from pagedserve.engine.async_llm import CoreFacts, EngineDeadError, front_end_input_processor
from pagedserve.engine.core_output import CoreInfo
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REPLICA_ERRORS = (RayError, RayServeException)
"""A replica that died, became unreachable or failed in Ray's own code (never the engine's refusals: those come
as ReplicaError items)."""
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

    async def _any_replica(self) -> bool:
        """Whether the board knows a live replica; True when the board cannot say now (the router will find out)."""
        try:
            return bool(await self.refresh())
        except REPLICA_ERRORS:
            return True

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
        if not self.is_alive() and not await self._any_replica():
            raise EngineDeadError("no engine replica is running")
        call = (prompt, params, request_id, priority, tenant, lora_request, hashes)
        avoid: list[str] = []
        attempts = max(MAX_ATTEMPTS, len(self.replicas))
        for attempt in range(1, attempts + 1):
            attempt_outputs = _Attempt(attempt)
            async with contextlib.aclosing(attempt_outputs.run(self._streaming, call, avoid)) as outputs:
                async for output in outputs:
                    yield output
            if attempt_outputs.done:
                return
            avoid += [attempt_outputs.failed_replica] if attempt_outputs.failed_replica else []
            if self.replicas and set(avoid) >= set(self.replicas):
                break  # every replica has said no: trying them again at once would only repeat it
            logger.info("request %s: not run (%s; attempt %d of %d)", request_id, attempt_outputs.failure, attempt,
                        attempts)
        raise attempt_outputs.last_error

    async def replica_metrics(self, timeout: float = 2.0) -> dict[str, str]:
        """Replica id -> its metrics text, asked of every running replica now; when they have not all answered
        within `timeout`, the replicas' last reports to the board instead."""
        try:
            answers = await self._engine.broadcast("metrics").results_async(timeout_s=timeout,
                                                                             return_exceptions=True)
        except (TimeoutError, RayServeException):  # one slow replica, or none: every text from the board
            answers = []
        texts = dict(a for a in answers if isinstance(a, tuple))
        for replica, text in (await self.refresh()).items():
            texts.setdefault(replica, text)
        return texts

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
        """Reset every replica's prefix cache (called off the event loop); False if any still holds blocks for
        running requests."""
        return all(self._engine.broadcast("reset_prefix_cache").results(timeout_s=timeout))

    def shutdown(self, timeout: Optional[float] = None) -> None:
        if self._watcher is not None:
            self._watcher.cancel()


class _Attempt:
    """One try of a request on whichever replica the router picks. `done`: it ended (finished, or an error the
    client must see); otherwise it failed before producing anything (`failure` says how; `last_error` is what
    the client gets if no other try succeeds) and may be sent again: the replica died, became unreachable, its
    engine was not running when the request came, or its queue was full (another replica's may not be)."""

    def __init__(self, number: int) -> None:
        # An engine that died *while* running the request is not tried again (the request may be what killed it).
        # From the second try on, "id in use" is the first try still being aborted on that replica.
        self.retried = {"unavailable", "queue_full"} | ({"id_in_use"} if number > 1 else set())
        self.done = False
        self.failure = ""
        self.last_error: Exception = EngineDeadError("no engine replica could run the request")
        self.failed_replica: Optional[str] = None
        """The replica that answered with a dead engine (alive to Ray until its health check fails) or a full queue:
        the next try avoids it."""

    async def run(self, handle, call, avoid: list[str]) -> AsyncIterator[RequestOutput]:
        prompt, params, request_id, priority, tenant, lora_request, hashes = call
        # call_id: Ray's internal request id is the HTTP request's, shared by all the calls it makes (n prompts).
        stream = handle.generate.remote(prompt, params, request_id, priority=priority, tenant=tenant,
                                        lora_request=lora_request, routing=hashes, avoid=avoid,
                                        call_id=uuid.uuid4().hex)
        started = settled = False
        try:
            async for item in stream:
                if isinstance(item, ReplicaError):
                    if item.kind not in self.retried or started:
                        settled = self.done = True
                        raise item.exception()
                    self.failure, self.failed_replica = f"{item.kind}: {item.message}", item.replica
                    self.last_error, settled = item.exception(), True
                    return
                started = True
                yield item
                if item.finished:
                    settled = self.done = True
                    return
            settled = self.done = True  # the stream ended without a last output: the replica says no more
        except RequestCancelledError:
            settled = self.done = True
            raise
        except REPLICA_ERRORS as e:
            if started:
                self.done = True  # not settled: cancel it there in case the replica is only unreachable
                raise EngineDeadError(f"the engine replica serving this request died or became unreachable "
                                      f"({type(e).__name__})") from None
            self.failure = type(e).__name__
            self.last_error = EngineDeadError(f"no engine replica could run the request (last: {self.failure})")
        finally:
            if not settled:
                stream.cancel()  # the client left, or the replica is unreachable: abort it there, free its blocks
