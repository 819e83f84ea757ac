"""The transport branch of the gateway's exception tree: failures talking to one replica.

Upstream clients (``gateway.upstream.aiohttp_client``, test doubles) raise only these, so no
HTTP library's exception leaks out of this package.  ``kind`` feeds passive health and the
``upstream_<kind>`` error label.  The client-facing errors they become live in
``gateway.errors`` (see the tree there).
"""

from __future__ import annotations

from gateway.errors import GatewayException


class UpstreamError(GatewayException):
    """A transport failure talking to one replica (raised by ``gateway.upstream`` clients).

    Never shown to a client as it is: the proxy handler translates it into a
    ``gateway.errors.GatewayError`` (``BadGateway``, ``GatewayTimeout``, ``StreamFailed``, ...).

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
