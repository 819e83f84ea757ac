"""A TCP forwarder in front of the real Redis that a test can cut and restore on the same port."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit


class FlakyProxy:
    """A TCP forwarder to the test session's Redis that the test can cut and restore (same port)."""

    def __init__(self, redis_url: str) -> None:
        target = urlsplit(redis_url)
        self._target = (target.hostname or "127.0.0.1", target.port or 6379)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def down(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        await self._server.wait_closed()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers += [writer, up_writer]

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
