"""`pagedserve serve`: build the engine, run uvicorn, and shut down gracefully on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading

import uvicorn

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.engine_args import engine_kwargs
from pagedserve.entrypoints.openai.api_server import build_app

logger = logging.getLogger("pagedserve.serve")


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM/SIGINT shutdown ends in a normal return (exit 0) instead of
    re-raising the signal once the server has stopped."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
            logger.info("pagedserve is ready: http://%s:%d/v1 (model: %s)", host, self.servers[0].sockets[0]
                        .getsockname()[1] if self.servers else self.config.port,
                        ", ".join(self.config.app.state.config.served_model_names))


def serve(args: argparse.Namespace) -> int:
    async_llm = AsyncLLM.from_kwargs(max_num_queued_requests=args.max_num_queued_requests, **engine_kwargs(args))
    try:
        app = build_app(async_llm, args)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", access_log=False,
                                timeout_graceful_shutdown=args.shutdown_timeout, lifespan="off")
        _Server(config).run()
    finally:
        async_llm.shutdown()
        logger.info("pagedserve stopped")
    return 0
