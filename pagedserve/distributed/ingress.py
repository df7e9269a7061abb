"""OpenAIIngress: the ingress deployment. It serves the single server's FastAPI app (same routes, gate, errors
and streaming) over a RemoteEngine, and its /metrics adds the replicas' metrics to its own."""

from __future__ import annotations

from ray import serve

from pagedserve.config import EngineConfig
from pagedserve.distributed.metrics_merge import merge_metrics
from pagedserve.distributed.remote_engine import RemoteEngine
from pagedserve.entrypoints.engine_args import engine_kwargs
from pagedserve.entrypoints.openai.api_server import build_app, server_config
from pagedserve.metrics.prometheus import PrometheusStatLogger


@serve.ingress()
class OpenAIIngress:
    async def __init__(self, args, engine, board) -> None:
        self.args = args
        config = EngineConfig.from_kwargs(**engine_kwargs(args))
        self.engine = await RemoteEngine.connect(engine, board, config)

    async def __serve_build_asgi_app__(self):
        config = server_config(self.args)
        metrics = PrometheusStatLogger(config.served_model_names[0], max_tenants=config.max_metric_tenants)

        async def render_metrics() -> bytes:
            replicas = await self.engine.replica_metrics()
            return merge_metrics(metrics.render().decode(), replicas).encode()

        self.asgi_app = build_app(self.engine, self.args, metrics=metrics, render_metrics=render_metrics)
        self.engine.start_watching()
        return _WithoutOwnRequestIdHeader(self.asgi_app)

    def reload_keys(self) -> bool:
        """Re-read the keys file (what SIGHUP on `pagedserve serve --ray` calls)."""
        return self.asgi_app.state.reload_keys()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class _WithoutOwnRequestIdHeader:
    """Ray Serve's proxy puts the request id in the request's X-Request-Id (the client's, or one it makes) and
    adds it to every response itself: the gate's copy of the same header would make it appear twice."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_once(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(k, v) for k, v in message.get("headers", ())
                                                  if k.lower() != b"x-request-id"]}
            await send(message)

        await self.app(scope, receive, send_once)
