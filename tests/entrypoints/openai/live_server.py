"""A live server on 127.0.0.1 (uvicorn in a background thread, free port) over the tiny Llama."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.engine_args import engine_kwargs
from pagedserve.entrypoints.openai.api_server import build_app

MODEL_NAME = "tiny"
CLI = [sys.executable, "-m", "pagedserve.entrypoints.cli"]
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

    @property
    def app(self):
        return self.server.config.app

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


def start_server(model_dir: str, *flags: str, log_requests: bool = False, restart_on_failure: bool = False,
                 **app_kwargs) -> LiveServer:
    """A server with these `pagedserve serve` flags; `app_kwargs` go to build_app (e.g. a rate_limiter). Its
    engine is not restarted when it dies unless `restart_on_failure` (`pagedserve serve` restarts by default)."""
    quiet = [] if log_requests else ["--disable-log-requests"]
    args = build_parser().parse_args(["serve", "--model", model_dir, "--served-model-name", MODEL_NAME, "other-name",
                                      *quiet, *ENGINE_FLAGS, *flags])
    async_llm = AsyncLLM.from_kwargs(max_num_queued_requests=args.max_num_queued_requests,
                                     restart_on_failure=restart_on_failure, **engine_kwargs(args))
    try:
        app = build_app(async_llm, args, **app_kwargs)
    except BaseException:
        async_llm.shutdown()
        raise
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


def stream_across_signal(proc, url: str, sig) -> list[str]:
    """The `data:` lines of a 200-token greedy stream during which the server process `proc` gets `sig` (sent
    once the first chunk has arrived)."""
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        proc.send_signal(sig)
        return [first] + [line for line in lines if line.startswith("data:")]


class ServeProcess:
    """`pagedserve serve` in a subprocess, its output collected by a thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([*CLI, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def wait_for_output(self, text: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, f"no {text!r} in {self.lines}"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(server, headers: dict | None = None) -> dict:
    """{(sample name, frozen labels): value} of the server's /metrics, parsed by prometheus_client's parser."""
    text = httpx.get(server.url + "/metrics", headers=headers).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


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
