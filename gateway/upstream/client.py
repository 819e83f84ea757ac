"""The upstream client contract used by the proxy, health checks and the engine scraper."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from gateway.config import ReplicaConfig, UpstreamSettings


class UpstreamResponse(Protocol):
    """A response whose headers have arrived; the body is read or streamed afterwards.

    Every method raises only ``gateway.upstream.errors.UpstreamError`` subclasses.
    """

    status: int
    content_type: str | None

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (no re-framing, no buffering)."""
        ...

    def release(self) -> None:
        """Body fully consumed: return the connection to the pool."""
        ...

    def abort(self) -> None:
        """Drop the connection now (client went away): the replica sees a disconnect and cancels."""
        ...


class UpstreamClient(Protocol):
    """One replica's pooled, keep-alive connection set."""

    base_url: str

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """Send a request and return once response headers are in."""
        ...

    async def get(self, path: str, timeout_s: float, headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        """A small bounded GET (health, metrics, models); raises ``UpstreamError`` on failure.

        ``headers`` carries the replica's own ``Authorization`` (vLLM ``--api-key`` guards
        ``/v1/models`` too).
        """
        ...


class ClientFactory(Protocol):
    def __call__(self, replica: ReplicaConfig, settings: UpstreamSettings) -> UpstreamClient: ...
