"""OpenAIIngress: the ingress deployment. It serves the single server's FastAPI app (same routes, gate, errors
and streaming) over a RemoteEngine, and its /metrics adds the replicas' metrics to its own."""

from __future__ import annotations

import asyncio

from ray import serve

from pagedserve.config import EngineConfig
from pagedserve.distributed.metrics_merge import merge_metrics
from pagedserve.distributed.remote_engine import RemoteEngine
from pagedserve.entrypoints.engine_args import engine_kwargs
from pagedserve.entrypoints.openai.api_server import build_app, server_config
from pagedserve.entrypoints.openai.errors import error_response
from pagedserve.logging_utils import LoggingConfig, configure_logging
from pagedserve.metrics.prometheus import PrometheusStatLogger


@serve.ingress()
class OpenAIIngress:
    async def __init__(self, args, engine, board) -> None:
        self.args = args
        # A Ray worker's root logger has no handler: without this the access log would be dropped.
        configure_logging(LoggingConfig(args.log_level, args.log_format), process_name="ingress")
        config = EngineConfig.from_kwargs(**engine_kwargs(args))
        self.engine = await RemoteEngine.connect(engine, board, config)

    async def __serve_build_asgi_app__(self):
        config = server_config(self.args)
        lora = self.engine.config.lora_config
        metrics = PrometheusStatLogger(config.served_model_names[0], max_tenants=config.max_metric_tenants,
                                       max_loras=lora.max_loras if lora.enable_lora else None)

        async def render_metrics() -> bytes:
            replicas = await self.engine.replica_metrics()
            return merge_metrics(metrics.render().decode(), replicas)

        self.asgi_app = build_app(self.engine, self.args, metrics=metrics, render_metrics=render_metrics)
        self.engine.start_watching()
        self.edge = IngressEdge(self.asgi_app)
        return self.edge

    def reload_keys(self) -> bool:
        """Re-read the keys file (what SIGHUP on `pagedserve serve --ray` calls)."""
        return self.asgi_app.state.reload_keys()

    async def drain(self, timeout: float) -> int:
        """Stop taking requests and wait for those in flight (what `pagedserve serve --ray` does on SIGTERM
        before Serve shuts down); the number still running after `timeout` seconds."""
        return await self.edge.drain(timeout)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class IngressEdge:
    """What the ingress adds around the app. It counts the HTTP requests in flight, so that a shutdown can wait
    for them (`drain`), and refuses new ones with a 503 once draining. And it drops the gate's X-Request-Id:
    Ray Serve's proxy puts the request id in the request (the client's, or one it makes) and adds it to every
    response itself, so the gate's copy of the same header would make it appear twice."""

    def __init__(self, app) -> None:
        self.app = app
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.draining:
            return await error_response("the server is shutting down", 503, code="shutting_down")(scope, receive,
                                                                                               send)

        async def send_once(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(k, v) for k, v in message.get("headers", ())
                                                  if k.lower() != b"x-request-id"]}
            await send(message)

        self.in_flight += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send_once)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def drain(self, timeout: float) -> int:
        """Refuse new requests and wait up to `timeout` seconds for those in flight; how many are left."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.in_flight
