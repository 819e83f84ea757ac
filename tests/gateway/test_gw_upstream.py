"""The aiohttp upstream client: exception mapping and never following redirects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from gateway.config import HealthSettings, ReplicaConfig, UpstreamSettings
from gateway.proxy.handler import report_failure
from gateway.replicas.pool import Replica
from gateway.upstream.aiohttp_client import AiohttpUpstream, _translate
from gateway.upstream.errors import UpstreamBroken, UpstreamConnectError, UpstreamDisconnected, UpstreamReadTimeout


def test_connect_timeout_is_a_retryable_connect_error() -> None:
    # aiohttp's ConnectionTimeoutError subclasses ServerTimeoutError: it must not read as a read timeout
    mapped = _translate(aiohttp.ConnectionTimeoutError("sock_connect"), started=False)
    assert isinstance(mapped, UpstreamConnectError) and mapped.before_send
    read = _translate(aiohttp.SocketTimeoutError("sock_read"), started=False)
    assert isinstance(read, UpstreamReadTimeout) and not read.before_send
    assert isinstance(_translate(aiohttp.ClientPayloadError("cut"), started=True), UpstreamBroken)


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def redirecting() -> AsyncIterator[tuple[str, list[str]]]:
    """A replica that redirects everything to another server, which records any hit."""
    hits: list[str] = []

    async def record(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"stolen": True})

    other = web.Application()
    other.router.add_route("*", "/{tail:.*}", record)
    other_runner, other_url = await _serve(other)

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(other_url + request.path)

    replica = web.Application()
    replica.router.add_route("*", "/{tail:.*}", redirect)
    replica_runner, replica_url = await _serve(replica)
    try:
        yield replica_url, hits
    finally:
        await replica_runner.cleanup()
        await other_runner.cleanup()


async def test_redirects_are_never_followed(redirecting: tuple[str, list[str]]) -> None:
    url, hits = redirecting
    client = AiohttpUpstream(ReplicaConfig(name="r0", url=url), UpstreamSettings())
    await client.start()
    try:
        response = await client.post("/v1/chat/completions", b'{"model":"m"}', {"Content-Type": "application/json"})
        assert response.status == 307
        await response.read()
        response.release()
        status, _ = await client.get("/health", timeout_s=5)
        assert status == 307
    finally:
        await client.close()
    assert hits == []


def test_a_close_before_answering_is_retryable_and_only_counts_like_a_5xx() -> None:
    mapped = _translate(aiohttp.ServerDisconnectedError(), started=False)
    assert isinstance(mapped, UpstreamDisconnected) and mapped.before_send
    assert isinstance(_translate(aiohttp.ServerDisconnectedError(), started=True), UpstreamBroken)

    settings = HealthSettings(passive_5xx_threshold=2, eject_s=10)
    replica = Replica(ReplicaConfig(name="r0", url="http://h:1"), None, settings)  # type: ignore[arg-type]
    report_failure(replica, mapped)  # one stale keep-alive close: still in
    assert replica.healthy
    report_failure(replica, UpstreamReadTimeout("slow"))  # slow is not broken
    assert replica.healthy and replica.passive_5xx == 1
    report_failure(replica, UpstreamBroken("reset mid-request"))  # a second failure in a row: out
    assert not replica.healthy

    refused = Replica(ReplicaConfig(name="r1", url="http://h:2"), None, settings)  # type: ignore[arg-type]
    report_failure(refused, UpstreamConnectError("connect timed out", before_send=True))
    assert refused.healthy  # one connect failure (an overloaded accept queue, say) never ejects
    report_failure(refused, UpstreamConnectError("refused", before_send=True))
    assert not refused.healthy  # a run of them does


def test_a_reset_before_response_headers_is_retryable() -> None:
    reset = aiohttp.ClientOSError(104, "Connection reset by peer")
    mapped = _translate(reset, started=False)
    assert isinstance(mapped, UpstreamDisconnected) and mapped.before_send
    assert not _translate(reset, started=True).before_send  # after headers: the client may have bytes
    assert not _translate(aiohttp.SocketTimeoutError(), started=False).before_send  # slow, maybe working


async def test_a_server_resetting_without_answering_raises_a_retryable_disconnect() -> None:
    import socket
    import struct

    async def reset_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the request arrived; the process dies: RST, no answer
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server = await asyncio.start_server(reset_at_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = AiohttpUpstream(ReplicaConfig(name="r0", url=f"http://127.0.0.1:{port}"), UpstreamSettings())
    await client.start()
    try:
        with pytest.raises(UpstreamDisconnected) as info:
            await client.post("/v1/chat/completions", b"{}", {"Content-Type": "application/json"})
        assert info.value.before_send
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def test_a_server_closing_without_answering_raises_a_retryable_disconnect() -> None:
    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the request arrived; close like a stale keep-alive peer
        writer.close()

    server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = AiohttpUpstream(ReplicaConfig(name="r0", url=f"http://127.0.0.1:{port}"), UpstreamSettings())
    await client.start()
    try:
        with pytest.raises(UpstreamDisconnected) as info:
            await client.post("/v1/chat/completions", b"{}", {"Content-Type": "application/json"})
        assert info.value.before_send
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
