"""The few ASGI primitives the simulator needs, without a framework.

A plain ASGI callable under uvicorn (httptools + uvloop) is several times cheaper per
request than a FastAPI route, and one simulator process has to outrun the gateway it is
used to measure.  These helpers are all the "framework" the app uses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_BODY_BYTES = 64 * 1024 * 1024

JSON = b"application/json"
EVENT_STREAM = b"text/event-stream; charset=utf-8"
TEXT = b"text/plain; charset=utf-8"


class ClientGone(Exception):
    """The client disconnected before we finished reading its request."""


class BodyTooLarge(Exception):
    pass


async def read_body(receive: Receive) -> bytes:
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def send_bytes(send: Send, status: int, payload: bytes, content_type: bytes = JSON) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def start_stream(send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", EVENT_STREAM)]})


def watch_disconnect(receive: Receive) -> asyncio.Future[Message]:
    """A future that resolves when the client goes away (or the response completes).

    Only valid once the request body has been read completely.
    """
    return asyncio.ensure_future(receive())
