"""aiohttp behind our :class:`UpstreamClient` interface: one pooled session per replica.

aiohttp's own exceptions never leave this module; they become ``gateway.errors.Upstream*``
with ``before_send`` telling the proxy whether retrying elsewhere is safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import aiohttp

from gateway.config import ReplicaConfig, UpstreamSettings
from gateway.upstream.errors import (
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamReadTimeout,
)


def _translate(exc: BaseException, *, started: bool) -> UpstreamError:
    """Map an aiohttp/asyncio exception to ours.  ``started``: response headers were received."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        # before ServerTimeoutError, its base class: a connect timeout never sent anything
        return UpstreamConnectError("connect timed out", before_send=True)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamConnectError(f"cannot connect: {exc.os_error or exc}", before_send=True)
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamReadTimeout("upstream read timed out")
    if isinstance(exc, aiohttp.ClientConnectionError) and not started:
        # The server closed or reset the connection before any response header: an idle
        # keep-alive race, a crash or a kill.  Nothing reached the client and nothing is left
        # running there, so it is retried like any other failure before the first byte.
        return UpstreamDisconnected(f"connection lost before answering: {type(exc).__name__}", before_send=True)
    return UpstreamBroken(f"{type(exc).__name__}: {exc}")


class AiohttpResponse:
    __slots__ = ("_resp", "content_type", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.content_type = resp.headers.get("Content-Type")

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            self._resp.close()
            raise _translate(exc, started=True) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._resp.content
        try:
            while True:
                data = await content.readany()
                if not data:
                    return
                yield data
        except (TimeoutError, aiohttp.ClientError) as exc:
            self._resp.close()
            raise _translate(exc, started=True) from exc

    def release(self) -> None:
        self._resp.release()

    def abort(self) -> None:
        self._resp.close()


class AiohttpUpstream:
    """Pooled keep-alive connections to one replica."""

    def __init__(self, replica: ReplicaConfig, settings: UpstreamSettings) -> None:
        self.base_url = replica.url
        self._settings = settings
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        if self._session is not None:
            return
        s = self._settings
        connector = aiohttp.TCPConnector(
            limit=s.max_connections_per_replica,
            limit_per_host=0,
            keepalive_timeout=s.keepalive_timeout_s,
            ttl_dns_cache=60,
        )
        self._session = aiohttp.ClientSession(
            base_url=None,
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout_s, sock_read=s.read_timeout_s),
            # no skip_auto_headers: it switches aiohttp to a slow per-request header path (~3% CPU)
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _require(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise UpstreamConnectError("upstream client is not started", before_send=True)
        return self._session

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> AiohttpResponse:
        session = self._require()
        try:
            # never follow redirects: a Location header must not send the prompt to another host
            resp = await session.post(self.base_url + path, data=body, headers=headers, allow_redirects=False)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _translate(exc, started=False) from exc
        return AiohttpResponse(resp)

    async def get(self, path: str, timeout_s: float, headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        session = self._require()
        try:
            async with session.get(
                self.base_url + path,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                allow_redirects=False,
                headers=headers,
            ) as resp:
                return resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _translate(exc, started=False) from exc


def aiohttp_factory(replica: ReplicaConfig, settings: UpstreamSettings) -> AiohttpUpstream:
    return AiohttpUpstream(replica, settings)
