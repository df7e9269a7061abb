"""Limits on clients that hold a connection without using it: uvicorn closes an idle keep-alive connection
(--timeout-keep-alive), but not a new connection that sends no request, or sends its headers a byte at a time.
`with_header_timeout` wraps uvicorn's HTTP protocol so that a connection whose first request's headers are not
complete within --timeout-request-headers seconds is closed. A body sent too slowly is refused by the routes
(--timeout-request-body, a 408)."""

from __future__ import annotations

from typing import Optional

from uvicorn.protocols.http.auto import AutoHTTPProtocol


def with_header_timeout(timeout: float, protocol_cls: type = AutoHTTPProtocol) -> type:
    """uvicorn's protocol class (httptools or h11, as uvicorn picks), closing a connection that has not
    completed a request's headers `timeout` seconds after it opened."""

    class HeaderTimeoutProtocol(protocol_cls):  # type: ignore[misc, valid-type]
        _first_request_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._first_request_timer = self.loop.call_later(timeout, self._no_request_in_time)

        def _no_request_in_time(self) -> None:
            if self.cycle is None and not self.transport.is_closing():  # no request has begun on it
                self.transport.close()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            if self._first_request_timer is not None:
                self._first_request_timer.cancel()
            super().connection_lost(exc)

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{protocol_cls.__name__}"
    return HeaderTimeoutProtocol
