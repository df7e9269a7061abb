"""Clients that hold a connection without using it: one that connects and sends nothing, or sends its headers or
its body a byte at a time, is cut off after the documented timeouts; the server keeps serving meanwhile."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from live_server import ENGINE_FLAGS, ServeProcess, free_port
from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.openai.server import uvicorn_config


@pytest.fixture(scope="module")
def strict_server(tiny_llama_dir):
    port = free_port()
    server = ServeProcess("--model", tiny_llama_dir, "--port", str(port), "--timeout-request-headers", "1",
                          "--timeout-request-body", "1", "--timeout-keep-alive", "1", "--timeout-stream-write", "1",
                          *ENGINE_FLAGS)
    try:
        server.wait_for_output("pagedserve is ready", timeout=120)
        yield port, server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def strict(strict_server) -> int:
    return strict_server[0]


def closed_after(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes `sock` (reading what it sends first); fails past `limit`."""
    sock.settimeout(limit)
    start = time.monotonic()
    while sock.recv(4096):
        pass
    return time.monotonic() - start


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(strict):
    with socket.create_connection(("127.0.0.1", strict)) as sock:
        assert 0.5 < closed_after(sock, 5) < 3


def test_headers_sent_a_byte_at_a_time_are_cut_off(strict):
    with socket.create_connection(("127.0.0.1", strict)) as sock:
        sock.settimeout(2)
        start = time.monotonic()
        with pytest.raises(OSError):  # the server closes the connection mid-headers: a send or recv fails
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
            sock.recv(1)
        assert time.monotonic() - start < 4  # the whole header would take 12 s: it was cut off


def test_a_body_sent_a_byte_at_a_time_gets_408_and_others_are_served_meanwhile(strict):
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", strict)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        sock.settimeout(0.2)
        reply = b""
        for byte in body:
            assert httpx.get(f"http://127.0.0.1:{strict}/health").status_code == 200
            try:
                sock.sendall(bytes([byte]))
                reply += sock.recv(65536)
            except (socket.timeout, OSError):
                pass
            if reply:
                break
        sock.settimeout(5)
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536)
        head, _, rest = reply.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(rest) < length:  # the body may come in a packet of its own
            rest += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(rest[:length])["error"]["code"] == "request_timeout"


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(strict):
    with socket.create_connection(("127.0.0.1", strict)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert closed_after(sock, 5) < 3


def test_a_later_request_whose_headers_trickle_in_is_cut_off_too(strict):
    with socket.create_connection(("127.0.0.1", strict)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.settimeout(2)
        start = time.monotonic()
        with pytest.raises(OSError):  # each byte would hold off the keep-alive timeout: the header timeout cuts in
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
            sock.recv(1)
        assert time.monotonic() - start < 4


def test_a_client_that_stops_reading_a_stream_is_cut_off_and_its_request_aborted(strict_server):
    port, server = strict_server
    body = json.dumps({"prompt": "Hi", "n": 64, "max_tokens": 240, "ignore_eos": True, "logprobs": 20,
                       "return_token_ids": True, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.connect(("127.0.0.1", port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: stalled-reader\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                     + body)
        start = time.monotonic()
        server.wait_for_output("(--timeout-stream-write)", timeout=60)  # reading nothing meanwhile
        server.wait_for_output("stalled-reader", timeout=10)
        line = next(line for line in server.lines if "stalled-reader" in line)
        assert "abort" in line, line  # the access log: its choices ended by the disconnect, not by length
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        assert time.monotonic() - start < 30
    finally:
        sock.close()


def test_the_timeout_flags_reach_uvicorn():
    args = build_parser().parse_args(["serve", "--timeout-keep-alive", "7", "--limit-concurrency", "64"])
    config = uvicorn_config(object(), args)
    assert (config.timeout_keep_alive, config.limit_concurrency) == (7, 64)
    assert config.http.__name__.startswith("Guarded")


@pytest.mark.parametrize("flags, message", [
    (["--timeout-request-headers", "0"], "--timeout-request-headers must be > 0"),
    (["--timeout-request-body", "-1"], "--timeout-request-body must be > 0"),
    (["--timeout-keep-alive", "0"], "--timeout-keep-alive must be > 0"),
    (["--timeout-stream-write", "0"], "--timeout-stream-write must be > 0"),
    (["--limit-concurrency", "0"], "--limit-concurrency must be >= 1"),
])
def test_a_bad_timeout_or_limit_exits_2_naming_the_flag(flags, message, capsys):
    from pagedserve.entrypoints.cli import main

    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err
