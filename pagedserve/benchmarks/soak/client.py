"""Sending one soak request and recording everything that came back (never raising)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Optional

from pagedserve.benchmarks.soak.mix import SoakRequest


@dataclass
class Reply:
    """What the server sent for one request, as raw as checks.py needs it."""

    status: Optional[int] = None
    body: object = None
    """A JSON body (dict), or the text of one that was not JSON."""
    events: list = field(default_factory=list)
    """A stream's `data:` payloads in order (dicts; the string "[DONE]" for the end marker)."""
    disconnected: bool = False
    """The client hung up on purpose before the reply was complete."""
    transport_error: Optional[str] = None
    """The connection failed (or the request outlasted its timeout) without the client's doing."""
    seconds: float = 0.0


async def send(session, base_url: str, request: SoakRequest, headers: dict, timeout: float) -> Reply:
    """Send `request`; a transport failure or a timeout is recorded in the Reply, not raised."""
    import aiohttp

    reply, start = Reply(), time.monotonic()
    try:
        await asyncio.wait_for(_exchange(session, base_url, request, headers, reply), timeout)
    except asyncio.TimeoutError:
        if request.disconnect_after is not None and not request.stream:
            reply.disconnected = True  # its own deadline came first: cancelling closed the connection
        else:
            reply.transport_error = f"no complete reply within {timeout:g} s"
    except (aiohttp.ClientError, OSError) as e:
        reply.transport_error = f"{type(e).__name__}: {e}"[:300]
    reply.seconds = time.monotonic() - start
    return reply


async def _exchange(session, base_url: str, request: SoakRequest, headers: dict, reply: Reply) -> None:
    if request.disconnect_after is not None and not request.stream:
        await asyncio.wait_for(_post(session, base_url, request, headers, reply), request.disconnect_after)
        return
    await _post(session, base_url, request, headers, reply)


async def _post(session, base_url: str, request: SoakRequest, headers: dict, reply: Reply) -> None:
    if request.malformed is not None:
        data, content_type = request.malformed.data, request.malformed.content_type
    else:
        data, content_type = json.dumps(request.body).encode(), "application/json"
    async with session.post(base_url + request.endpoint, data=data,
                            headers={**headers, "Content-Type": content_type}) as resp:
        reply.status = resp.status
        if resp.status == 200 and resp.content_type == "text/event-stream":
            await _read_events(resp, request, reply)
            return
        text = await resp.text()
        try:
            reply.body = json.loads(text)
        except ValueError:
            reply.body = text


async def _read_events(resp, request: SoakRequest, reply: Reply) -> None:
    """Read SSE `data:` lines; hang up after `disconnect_after` chunks when the request says so."""
    if request.disconnect_after == 0:
        resp.close()
        reply.disconnected = True
        return
    buffer = b""
    async for raw in resp.content.iter_any():
        buffer += raw
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].decode("utf-8", "replace")
            reply.events.append("[DONE]" if payload == "[DONE]" else _parsed(payload))
            if request.disconnect_after is not None and len(reply.events) >= request.disconnect_after \
                    and reply.events[-1] != "[DONE]":
                resp.close()
                reply.disconnected = True
                return


def _parsed(payload: str):
    try:
        return json.loads(payload)
    except ValueError:
        return payload  # not JSON: checks.py reports it
