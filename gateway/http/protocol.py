"""uvicorn's httptools protocol with the limits a public listener needs.

uvicorn (0.54, httptools) has no header-read or body-read timeout, no header size or count
limit for httptools, and answers unparseable requests in plain text.  A connection that sends
half a request line, or a body one byte a minute, holds a socket and a task forever; a
10 MB ``Authorization`` header is buffered and forwarded.  This subclass adds, per connection:

- a **header timeout**: the request head must be complete within ``header_timeout_s`` of its
  first byte (or of the connection opening) → ``408`` and close;
- a **body timeout**: the body must be complete within ``body_timeout_s`` of the head → the
  connection is closed (``408`` if the app has not answered yet);
- a **header size limit** (``max_header_bytes``, request line included) and a **header
  count limit** (``max_headers``) → ``431`` and close;
- unparseable bytes (garbage, unknown methods) → ``400`` in OpenAI's error shape.

Every refusal is JSON in OpenAI's shape and closes the connection.  The limits come in as a
class attribute: :func:`protocol_class` makes a subclass per server (uvicorn builds one
protocol instance per connection from the class it is given).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.errors import error_bytes

log = logging.getLogger("prefix_gateway.http")


@dataclass(frozen=True, slots=True)
class HttpLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_header_bytes: int
    max_headers: int


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the refusal itself is on the protocol."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` plus header/body timeouts, header limits and JSON refusals."""

    limits: HttpLimits

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_head = True
        self._head_bytes = 0
        self._header_count = 0
        self._refusal: tuple[int, str, str] | None = None
        self._timer: asyncio.TimerHandle | None = None
        # a fresh connection that never completes a request head is closed too
        self._arm(self.limits.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # -- timers ------------------------------------------------------------------------
    def _arm(self, delay: float, callback: Any) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing() or not self._in_head:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # a pipelined head waits (reading is paused) while the previous answer streams:
            # writing a 408 now would land inside that answer
            self._arm(self.limits.header_timeout_s, self._head_timed_out)
            return
        if self._head_bytes == 0:
            self.transport.close()  # idle: nothing to answer
            return
        self._refuse(408, "request headers not received in time", "request_timeout")

    def _body_timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        log.info("closing connection from %s: request body not received in time", _addr(self.client))
        if cycle is not None and not cycle.response_started:
            # the app is waiting for the body: it sees a disconnect and answers nobody
            cycle.response_started = True
            cycle.disconnected = True
            cycle.message_event.set()
            self._write_error(408, "request body not received in time", "request_timeout")
        self.transport.close()

    # -- parsing -----------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self._in_head:
            if self._timer is None:  # the first byte of the next request on a kept-alive connection
                self._arm(self.limits.header_timeout_s, self._head_timed_out)
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            if self._refusal is not None:
                self._refuse(*self._refusal)
            else:
                invalid_method = isinstance(exc, httptools.HttpParserInvalidMethodError)
                what = "unknown HTTP method or not an HTTP request" if invalid_method else "invalid HTTP request"
                self._refuse(400, what, "invalid_request")
            return
        if self._in_head and self._head_bytes > self.limits.max_header_bytes and not self.transport.is_closing():
            self._refuse(431, f"request headers exceed {self.limits.max_header_bytes} bytes", "headers_too_large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._refusal = (431, f"more than {self.limits.max_headers} request headers", "headers_too_large")
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.limits.body_timeout_s, self._body_timed_out)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head = True
        self._head_bytes = 0
        super().on_message_complete()

    def _unsupported_upgrade_warning(self) -> None:
        # ws="none" on purpose: the request is served as plain HTTP; uvicorn's warning (which
        # tells the operator to install a WebSocket library) would only be noise per request
        log.debug("ignored an Upgrade request from %s", _addr(self.client))

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "invalid HTTP request", "invalid_request")

    # -- refusals ----------------------------------------------------------------------
    def _refuse(self, status: int, message: str, code: str) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        log.info("refused a request from %s: %d %s", _addr(self.client), status, code)
        self._write_error(status, message, code)
        self.transport.close()

    def _write_error(self, status: int, message: str, code: str) -> None:
        body = error_bytes(status, message, code)
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
            body,
        ]
        self.transport.write(b"".join(head))


def _addr(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "-"


def protocol_class(limits: HttpLimits) -> type[GuardedHttpToolsProtocol]:
    """A protocol class bound to ``limits`` (what ``uvicorn.Config(http=...)`` takes)."""
    return type("GatewayHttpProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})
