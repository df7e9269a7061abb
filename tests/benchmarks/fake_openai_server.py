"""A tiny OpenAI-compatible server for the serving-benchmark tests: it streams with exactly known delays.

Each request gets `max_tokens` chunks of one token ("tok "): the first after `ttft_s`, each next one `itl_s`
later (a prompt containing "SLOW" waits `slow_extra_s` more before its first chunk). A prompt containing
"FAIL" gets HTTP 500. The server records, per prompt, the perf_counter time at which it wrote each chunk:
the client runs in the same process, so the tests can compare the client's receive times with these.

Tenants: with `api_keys`, every route wants `Authorization: Bearer <one of them>` (HTTP 401 otherwise), as
`pagedserve serve --api-key` does; `slow_keys` (key -> seconds) delays the first chunk of that key's
requests; `received` records every completion request: arrival time, Authorization header and body.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Optional

from aiohttp import web


class FakeOpenAIServer:
    def __init__(self, ttft_s: float = 0.05, itl_s: float = 0.02, slow_extra_s: float = 0.15,
                 send_usage: bool = True, metrics_prefix: str = "pagedserve:", text: str = "tok ",
                 api_keys: tuple[str, ...] = (), slow_keys: Optional[dict[str, float]] = None) -> None:
        self.text = text
        self.api_keys = set(api_keys)
        self.slow_keys = slow_keys or {}
        self.received: list[dict] = []  # {"time": perf_counter, "authorization": header or None, "body": ...}
        self.ttft_s, self.itl_s, self.slow_extra_s = ttft_s, itl_s, slow_extra_s
        self.send_usage = send_usage
        self.metrics_prefix = metrics_prefix
        self.sent: dict[str, list[float]] = {}  # prompt (as str) -> write times of its chunks
        self.bodies: list[dict] = []
        self.num_requests = 0
        self.port = 0
        self._loop: asyncio.AbstractEventLoop = None
        self._runner: web.AppRunner = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- handlers
    @web.middleware
    async def check_key(self, request: web.Request, handler):
        if self.api_keys:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or token.strip() not in self.api_keys:
                return web.json_response({"error": {"message": "Invalid or missing API key", "code": 401}}, status=401)
        return await handler(request)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        p, n = self.metrics_prefix, self.num_requests
        text = (f"# TYPE {p}request_queue_time_seconds histogram\n"
                f'{p}request_queue_time_seconds_bucket{{le="+Inf"}} {n}\n'
                f"{p}request_queue_time_seconds_sum {0.004 * n}\n"
                f"{p}request_queue_time_seconds_count {n}\n"
                f"# TYPE {p}num_preemptions counter\n{p}num_preemptions_total {2 * n}\n"
                f"# TYPE {p}prefix_cache_hits counter\n{p}prefix_cache_hits_total {16 * n}\n"
                f"# TYPE {p}prefix_cache_queries counter\n{p}prefix_cache_queries_total {64 * n}\n")
        return web.Response(text=text, content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        body = await request.json()
        self.bodies.append(body)
        auth = request.headers.get("Authorization")
        self.received.append({"time": arrived, "authorization": auth, "body": body})
        key_delay = self.slow_keys.get((auth or "").partition(" ")[2], 0.0)
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        key = prompt if isinstance(prompt, str) else json.dumps(prompt)
        n = body.get("max_completion_tokens" if chat else "max_tokens") or 16
        if "FAIL" in key:
            return web.json_response({"error": {"message": "injected failure", "code": 500}}, status=500)
        self.num_requests += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        times = self.sent.setdefault(key, [])
        await asyncio.sleep(self.ttft_s + key_delay + (self.slow_extra_s if "SLOW" in key else 0.0))
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl_s)
            choice = ({"index": 0, "delta": {"content": self.text}, "finish_reason": None} if chat
                      else {"index": 0, "text": self.text, "finish_reason": None})
            times.append(time.perf_counter())
            await resp.write(f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n".encode())
        if self.send_usage:
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
            await resp.write(f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- life cycle
    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application(middlewares=[self.check_key])
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._loop.run_until_complete(web.SockSite(self._runner, sock).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def __enter__(self) -> "FakeOpenAIServer":
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "fake server did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
