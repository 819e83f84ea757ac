"""The gateway's Redis clients speak RESP2 whatever redis-py defaults to (8.x: RESP3)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.state.local_broker import LocalBroker
from gateway.state.redis_client import open_redis


def test_clients_ask_for_resp2_and_keepalive_only_over_tcp() -> None:
    tcp = open_redis("redis://127.0.0.1:6379/0", connect_timeout_s=1.0, timeout_s=1.0)
    unix = open_redis("unix:///tmp/nothing.sock", connect_timeout_s=1.0, timeout_s=1.0)
    assert tcp.connection_pool.connection_kwargs["protocol"] == 2
    assert tcp.connection_pool.connection_kwargs["socket_keepalive"] is True
    assert unix.connection_pool.connection_kwargs["protocol"] == 2
    assert "socket_keepalive" not in unix.connection_pool.connection_kwargs


def test_the_local_broker_refuses_resp3_as_a_resp2_server_does(tmp_path: Path) -> None:
    async def hello() -> bytes:
        broker = LocalBroker(str(tmp_path / "b.sock"))
        await broker.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "b.sock"))
            writer.write(b"*2\r\n$5\r\nHELLO\r\n$1\r\n3\r\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 5)
            writer.close()
            return line
        finally:
            await broker.stop()

    # redis-py falls back to RESP2 only on an "unknown command" or NOPROTO error; "+OK" broke it
    assert asyncio.run(hello()).startswith(b"-NOPROTO")
