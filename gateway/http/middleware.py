"""Cross-cutting concerns as one small pure-ASGI middleware: request id, timing, access log.

Pure ASGI (not ``BaseHTTPMiddleware``) so it adds microseconds, not a task and a queue, to
every request.  It accepts the client's request id (or makes one), exposes it to handlers
through the scope, echoes it in the response, and writes one access-log line per request —
skipping probe paths unless configured — with whatever the handler put in the scope's
log-info dict (route, replica, tokens; never prompt text).
"""

from __future__ import annotations

import os
from time import perf_counter
from typing import Any

from gateway.observe.logs import AccessLog
from gateway.proxy.handler import LOG_INFO_KEY, REQUEST_ID_KEY

_MAX_ID = 128


def _clean_id(raw: bytes) -> str | None:
    if not raw or len(raw) > _MAX_ID:
        return None
    text = raw.decode("latin-1")
    return text if text.isprintable() and " " not in text else None


class RequestContextMiddleware:
    def __init__(self, app: Any, access_log: AccessLog, request_id_header: str = "x-request-id") -> None:
        self.app = app
        self.access_log = access_log
        self.header = request_id_header.lower().encode("latin-1")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = perf_counter()
        header = self.header
        request_id = None
        for name, value in scope["headers"]:
            if name == header:
                request_id = _clean_id(value)
                break
        if request_id is None:
            request_id = os.urandom(16).hex()
        scope[REQUEST_ID_KEY] = request_id
        info: dict[str, Any] = {}
        scope[LOG_INFO_KEY] = info
        rid = request_id.encode("latin-1")
        status = 500

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (header, rid)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            status = info.pop("status", status)  # the handler knows better (499: client went away)
            path = scope["path"]
            if self.access_log.wants(path):
                client = scope.get("client")
                addr = f"{client[0]}:{client[1]}" if client else "-"
                self.access_log.write(
                    addr, scope["method"], path, status, perf_counter() - t0, request_id, info or None
                )
