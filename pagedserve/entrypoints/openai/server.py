"""`pagedserve serve`: build the engine, run uvicorn (HTTPS with --ssl-keyfile/--ssl-certfile), shut down
gracefully on SIGTERM/SIGINT, and re-read the keys file on SIGHUP."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import threading
from typing import Callable, Optional

import uvicorn

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.engine_args import engine_kwargs
from pagedserve.entrypoints.openai.api_server import build_app, server_config, tenant_store
from pagedserve.entrypoints.openai.allowed_paths import resolved_dirs
from pagedserve.entrypoints.openai.slow_clients import guarded_protocol

logger = logging.getLogger("pagedserve.serve")


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM/SIGINT shutdown ends in a normal return (exit 0) instead of
    re-raising the signal once the server has stopped, and that SIGHUP calls `on_sighup` on the event loop
    (connections and streams in flight are not touched)."""

    def __init__(self, config: uvicorn.Config, on_sighup: Optional[Callable[[], object]] = None) -> None:
        super().__init__(config)
        self.on_sighup = on_sighup

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        if self.on_sighup is not None:
            loop = asyncio.get_running_loop()  # capture_signals runs inside uvicorn's serve()
            # The handler only schedules: the reload runs on the loop, between requests' steps, not mid-bytecode.
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP,
                                                    lambda *_: loop.call_soon_threadsafe(self.on_sighup))
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
            scheme = "https" if self.config.ssl_certfile else "http"
            logger.info("pagedserve is ready: %s://%s:%d/v1 (model: %s)", scheme, host, self.servers[0].sockets[0]
                        .getsockname()[1] if self.servers else self.config.port,
                        ", ".join(self.config.app.state.config.served_model_names))


def _check_server_flags(args: argparse.Namespace) -> None:
    """The server's own flags, checked before the model loads."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both for HTTPS, or neither")
    if args.max_metric_tenants < 0:
        raise ValueError(f"--max-metric-tenants must be >= 0, got {args.max_metric_tenants}")
    for flag in ("timeout_keep_alive", "timeout_request_headers", "timeout_request_body", "timeout_stream_write"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.limit_concurrency is not None and args.limit_concurrency < 1:
        raise ValueError(f"--limit-concurrency must be >= 1, got {args.limit_concurrency}")
    resolved_dirs(args.allowed_lora_dirs or [], "--allowed-lora-dirs")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")


def uvicorn_config(app, args: argparse.Namespace) -> uvicorn.Config:
    # log_config=None: uvicorn's loggers propagate to the handler main() set up (--log-format applies)
    return uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                          log_level=getattr(args, "log_level", "info"), access_log=False,
                          timeout_graceful_shutdown=args.shutdown_timeout, lifespan="off",
                          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                          timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency,
                          http=guarded_protocol(args.timeout_request_headers, args.timeout_stream_write))


def serve(args: argparse.Namespace) -> int:
    _check_server_flags(args)
    tenants = tenant_store(server_config(args))  # a bad keys file stops us before the model loads
    if tenants.keys_file is not None:
        logger.info("keys file %s: %d tenant(s): %s (SIGHUP re-reads it)", tenants.keys_file,
                    len(tenants.registry.names()), ", ".join(tenants.registry.names()))
    async_llm = AsyncLLM.from_kwargs(max_num_queued_requests=args.max_num_queued_requests,
                                     restart_on_failure=args.restart_on_engine_failure, **engine_kwargs(args))
    try:
        app = build_app(async_llm, args, tenants=tenants)
        config = uvicorn_config(app, args)
        _Server(config, on_sighup=tenants.reload if tenants.keys_file else None).run()
    finally:
        async_llm.shutdown()
        logger.info("pagedserve stopped")
    return 0
