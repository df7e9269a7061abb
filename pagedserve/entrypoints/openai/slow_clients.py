"""Limits on clients that hold a connection without using it. uvicorn closes an idle keep-alive connection
(--timeout-keep-alive), but not one that sends a request's headers a byte at a time (or nothing at all), nor one
that stops reading a streamed response (the server's writes back up into the socket buffers, and the stream
waits on them forever while its request keeps generating). `guarded_protocol` wraps uvicorn's HTTP protocol:
- a connection that has not completed a request's headers --timeout-request-headers seconds after it opened, or
  after its previous response ended, is closed;
- a connection whose writes stay paused (the transport's buffer full: the kernel's buffers and 64 KiB more, a
  bounded amount) for --timeout-stream-write seconds is aborted: the route sees the disconnect and aborts the
  engine request, as for a client that hung up.
A body sent too slowly is refused by the routes (--timeout-request-body, a 408)."""

from __future__ import annotations

import logging
from typing import Optional

from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger(__name__)


def guarded_protocol(header_timeout: float, write_timeout: float, protocol_cls: type = AutoHTTPProtocol) -> type:
    """uvicorn's protocol class (httptools or h11, as uvicorn picks) with the two limits above."""

    class GuardedProtocol(protocol_cls):  # type: ignore[misc, valid-type]
        _headers_timer = None
        _write_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._expect_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # A pipelined request may already be running (super() started it): only an idle connection waits
            if not self.transport.is_closing() and self._idle():
                self._expect_headers()  # the next request on this keep-alive connection has as long

        def _expect_headers(self) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
            self._headers_timer = self.loop.call_later(header_timeout, self._headers_late, self.cycle)

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _headers_late(self, cycle_before) -> None:
            # self.cycle is replaced when a request's headers are complete: unchanged (and finished) means none came
            if self.cycle is cycle_before and self._idle() and not self.transport.is_closing():
                self.transport.close()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._writes_stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _writes_stalled(self) -> None:
            self._write_timer = None
            logger.warning("closing a connection from %s: it read nothing of its response for %g s "
                           "(--timeout-stream-write)", _peer(self.transport), write_timeout)
            self.transport.abort()  # close() would wait to flush the buffer the client does not read

        def connection_lost(self, exc: Optional[Exception]) -> None:
            for timer in (self._headers_timer, self._write_timer):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

    GuardedProtocol.__name__ = f"Guarded{protocol_cls.__name__}"
    return GuardedProtocol


def _peer(transport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "a client"
