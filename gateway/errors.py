"""The gateway's one exception tree, and the renderer of OpenAI-shaped error bodies.

Every exception the gateway raises on purpose descends from :class:`GatewayException`, so
its branches say what kind of failure it is (modelled on httpx's ``_exceptions.py``)::

    GatewayException
    ├── GatewayError                 what a client sees: status, OpenAI type and code, metric kind
    │   ├── BadRequest                 400 invalid_request
    │   ├── Unauthorized               401 invalid_api_key
    │   ├── NotFound                   404 not_found
    │   │   └── ModelNotFound            404 model_not_found
    │   ├── PayloadTooLarge            413 request_too_large
    │   ├── RateLimited                429 rate_limit_exceeded (with retry-after headers)
    │   ├── InternalError              500 internal_error
    │   ├── BadGateway                 502 upstream_unavailable: every attempt failed before an answer
    │   ├── RedirectRefused            502 upstream_redirect: a replica's redirect, never followed
    │   ├── StreamFailed               502 upstream_stream_failed: sent as the last SSE event
    │   ├── NoHealthyReplica           503 no_healthy_replica
    │   ├── Overloaded                 503 server_overloaded (with retry-after): a gateway-wide cap is full
    │   └── GatewayTimeout             504 upstream_timeout
    ├── UpstreamError                transport failure with one replica (gateway.upstream.errors)
    │   ├── UpstreamConnectError, UpstreamDisconnected, UpstreamAbandoned   (before_send: retry)
    │   └── UpstreamReadTimeout, UpstreamStalled, UpstreamBroken
    ├── ClientDisconnected           the client went away: nothing can be answered
    └── SetupError                   what the config asks for cannot be set up
        ├── TokenizerUnavailable       (gateway.tokens.tokenizer; also a RuntimeError)
        └── ConfigError                (gateway.config; also a ValueError)

Upstream clients raise only ``UpstreamError``s (no library exception leaks past
``gateway.upstream``); the proxy handler turns them into ``GatewayError``s in one place
(``raise ... from exc``), and one renderer turns those into ``{"error": {...}}`` bodies:
clients never see a traceback.
"""

from __future__ import annotations

import json
from typing import Any


class GatewayException(Exception):
    """The root of every exception the gateway raises on purpose (see the tree above)."""


class GatewayError(GatewayException):
    """An error the gateway answers with; subclasses fix status, type and code."""

    status: int = 500
    type: str = "server_error"
    code: str = "internal_error"
    #: bounded metric label for ``prefix_gateway_errors_total{kind}``
    kind: str = "internal"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.route: str | None = None  # set when the error is known to belong to a route
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)

    def to_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    kind = "bad_request"


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    kind = "unauthorized"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"
    kind = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"
    kind = "unknown_model"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    kind = "too_large"


class RateLimited(GatewayError):
    """Over a per-key limit: OpenAI's 429 shape, with ``retry-after`` (and ``retry-after-ms``,
    which the official SDKs honour) in ``headers``."""

    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"
    kind = "rate_limited"

    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s
        self.headers = retry_after_headers(retry_after_s)


def retry_after_headers(retry_after_s: float) -> list[tuple[bytes, bytes]]:
    """``retry-after`` in whole seconds (rounded up, never 0) and ``retry-after-ms``, which the
    official SDKs honour (they retry 429 and 5xx after it)."""
    seconds = max(1, -int(-retry_after_s // 1))
    return [
        (b"retry-after", str(seconds).encode()),
        (b"retry-after-ms", str(max(1, int(retry_after_s * 1000))).encode()),
    ]


class NoHealthyReplica(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_replica"
    kind = "no_replica"


class Overloaded(GatewayError):
    """A gateway-wide cap (``server.max_concurrency``, ``server.max_buffered_body_bytes``) is full:
    the request is shed before it costs more memory, and the client is told when to come back.

    503 rather than 429: the client did nothing wrong; the process is busy (OpenAI answers
    overload the same way).  ``what`` says which cap, for the stats (``concurrency`` or
    ``body_bytes``)."""

    status = 503
    type = "server_error"
    code = "server_overloaded"
    kind = "overloaded"

    def __init__(self, message: str, *, what: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.what = what
        self.retry_after_s = retry_after_s
        self.headers = retry_after_headers(retry_after_s)


class BadGateway(GatewayError):
    """Every attempt failed before a response started (connection refused, reset, ...)."""

    status = 502
    type = "server_error"
    code = "upstream_unavailable"
    kind = "upstream_connect"


class RedirectRefused(GatewayError):
    """A replica answered with a redirect: never followed (the prompt must not go to another host)."""

    status = 502
    type = "server_error"
    code = "upstream_redirect"
    kind = "upstream_redirect"


class GatewayTimeout(GatewayError):
    """A replica did not answer (or finish answering) within ``upstream.read_timeout_s``."""

    status = 504
    type = "server_error"
    code = "upstream_timeout"
    kind = "upstream_timeout"


class InternalError(GatewayError):
    """A bug or an unexpected failure inside the gateway: the client gets a plain 500, the log the detail."""

    status = 500
    type = "server_error"
    code = "internal_error"
    kind = "internal"


class StreamFailed(GatewayError):
    """The replica failed after the stream started: sent as a final SSE ``data:`` event, not a status."""

    status = 502
    type = "server_error"
    code = "upstream_stream_failed"
    kind = "upstream_broken"


class ClientDisconnected(GatewayException):
    """The client went away; nothing can be answered (not a GatewayError on purpose: no status to send)."""


class SetupError(GatewayException):
    """What the config asks for cannot be set up (a vocabulary that will not load, an invalid file).

    Raised while building or rebuilding components, never on a request's path as such: a
    request that needs the missing part fails with a ``GatewayError`` of its own.
    """


#: machine-readable ``code`` for errors rendered from a bare HTTP status (router 404/405, ...)
STATUS_CODES: dict[int, str] = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    422: "invalid_request",
    429: "rate_limited",
    500: "internal_error",
    502: "upstream_unavailable",
    503: "service_unavailable",
    504: "upstream_timeout",
}


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: the one renderer every error goes through (``code`` is always a string)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def status_error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """An ad-hoc error (e.g. 404/405 from the router) from its HTTP status, in OpenAI's shape."""
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return error_body(message, type_, code or STATUS_CODES.get(status, f"http_{status}"))


def error_bytes(status: int, message: str, code: str | None = None) -> bytes:
    return json.dumps(status_error_body(status, message, code)).encode()
