"""One error hierarchy for the gateway, rendered in OpenAI's error format.

Every failure a client can see is a :class:`GatewayError` with an HTTP status, an OpenAI
``type`` and a machine-readable ``code``.  Upstream (HTTP client) exceptions are translated
into these at the boundary (``raise ... from exc``) so the request path never leaks a
library's exception, and one renderer turns them into ``{"error": {...}}`` bodies: clients
never see a traceback.
"""

from __future__ import annotations

import json
from typing import Any


class GatewayError(Exception):
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
        seconds = max(1, -int(-retry_after_s // 1))  # whole seconds, rounded up, never 0
        self.headers = [
            (b"retry-after", str(seconds).encode()),
            (b"retry-after-ms", str(max(1, int(retry_after_s * 1000))).encode()),
        ]


class NoHealthyReplica(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_replica"
    kind = "no_replica"


class UpstreamUnavailable(GatewayError):
    """Every attempt failed before a response started (connection refused, reset, ...)."""

    status = 502
    type = "server_error"
    code = "upstream_unavailable"
    kind = "upstream_connect"


class UpstreamRedirect(GatewayError):
    """A replica answered with a redirect: never followed (the prompt must not go to another host)."""

    status = 502
    type = "server_error"
    code = "upstream_redirect"
    kind = "upstream_redirect"


class UpstreamTimeout(GatewayError):
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


class UpstreamStreamFailed(GatewayError):
    """The replica failed after the stream started: sent as a final SSE ``data:`` event, not a status."""

    status = 502
    type = "server_error"
    code = "upstream_stream_failed"
    kind = "upstream_broken"


class UpstreamError(Exception):
    """A transport failure talking to one replica (raised by ``gateway.upstream`` clients).

    ``before_send`` is True when retrying elsewhere is safe: the request never reached the
    replica (connection refused, DNS failure) or the replica closed the connection without
    starting an answer.
    """

    kind = "upstream_error"

    def __init__(self, message: str, *, before_send: bool = False) -> None:
        super().__init__(message)
        self.before_send = before_send


class UpstreamConnectError(UpstreamError):
    kind = "connect"


class UpstreamDisconnected(UpstreamError):
    """The replica closed the connection before any response header (usually a stale keep-alive race).

    Raised with ``before_send=True``: retrying elsewhere is safe, but one such close is no proof
    the replica is down, so passive health counts it like a 5xx instead of ejecting at once.
    """

    kind = "disconnected"


class UpstreamReadTimeout(UpstreamError):
    kind = "timeout"


class UpstreamAbandoned(UpstreamError):
    """The gateway stopped waiting for a replica that went down (frozen, ejected) while a healthy one is left.

    Raised with ``before_send=True`` (no byte reached the client, so retrying elsewhere is safe);
    it says nothing new about the replica, which is already down, so passive health ignores it.
    """

    kind = "abandoned"


class UpstreamStalled(UpstreamError):
    """A started stream sent nothing for ``upstream.stream_idle_timeout_s``."""

    kind = "stalled"


class UpstreamBroken(UpstreamError):
    """The connection broke after the request was sent (reset, truncated response)."""

    kind = "broken"


class ClientDisconnected(Exception):
    """The client went away; nothing can be answered (not a GatewayError on purpose)."""


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
