"""A live server on 127.0.0.1 (uvicorn in a background thread, free port) over the tiny Llama."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest
import uvicorn

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.engine_args import engine_kwargs
from pagedserve.entrypoints.openai.api_server import build_app

MODEL_NAME = "tiny"
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 23), "--max-model-len", "256"]


@dataclass
class LiveServer:
    url: str
    async_llm: AsyncLLM
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def engine(self):
        return self.async_llm

    def wait_idle(self, timeout: float = 5.0) -> float:
        """Seconds until the engine has nothing left running (fails after `timeout`)."""
        start = time.monotonic()
        while self.async_llm.has_unfinished_requests():
            assert time.monotonic() - start < timeout, "requests still running"
            time.sleep(0.01)
        return time.monotonic() - start

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.async_llm.shutdown()


def start_server(model_dir: str, *flags: str) -> LiveServer:
    args = build_parser().parse_args(["serve", "--model", model_dir, "--served-model-name", MODEL_NAME, "other-name",
                                      "--disable-log-requests", *ENGINE_FLAGS, *flags])
    async_llm = AsyncLLM.from_kwargs(max_num_queued_requests=args.max_num_queued_requests, **engine_kwargs(args))
    app = build_app(async_llm, args)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", async_llm, server, thread)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    live = start_server(tiny_llama_dir)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
