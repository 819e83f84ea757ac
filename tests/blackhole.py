"""A TCP endpoint in front of the test Redis that a test switches between three behaviours.

- ``forward``: a plain forwarder to the real Redis;
- ``blackhole``: accepts connections and reads what is sent, never answers (a frozen
  primary, a dropped path: calls do not fail, they time out);
- ``swallow``: forwards requests to Redis but drops its replies (the command ran, the client
  never hears: a lost reply).

The mode applies to connections already open too (a live path going dark).  It runs on its
own event loop in a thread so synchronous tests and in-thread gateways can use it alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Literal
from urllib.parse import urlsplit

Mode = Literal["forward", "blackhole", "swallow"]


class SwitchableRedis:
    """Listen on 127.0.0.1 (a free port); ``url`` is what gateways are pointed at."""

    def __init__(self, redis_url: str | None, mode: Mode = "blackhole") -> None:
        target = urlsplit(redis_url) if redis_url else None
        self._target = (target.hostname or "127.0.0.1", target.port or 6379) if target else None
        self.mode: Mode = mode
        self.accepted = 0  # connections accepted, in any mode
        self.requests_bytes = 0  # bytes clients sent (forwarded or not)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="switchable-redis", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> SwitchableRedis:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._writers.append(writer)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        if self._target is not None:
            with contextlib.suppress(OSError):
                upstream = await asyncio.open_connection(*self._target)
                self._writers.append(upstream[1])

        async def requests() -> None:
            while data := await reader.read(65536):
                self.requests_bytes += len(data)
                if self.mode != "blackhole" and upstream is not None:
                    upstream[1].write(data)
                    await upstream[1].drain()

        async def replies() -> None:
            if upstream is None:
                return
            while data := await upstream[0].read(65536):
                if self.mode == "forward":
                    writer.write(data)
                    await writer.drain()

        with contextlib.suppress(Exception):
            await asyncio.gather(requests(), replies())
        writer.close()
        if upstream is not None:
            upstream[1].close()


@contextlib.contextmanager
def switchable_redis(redis_url: str | None, mode: Mode = "blackhole") -> Iterator[SwitchableRedis]:
    """A :class:`SwitchableRedis` for the ``with`` block (``redis_url`` None: blackhole only)."""
    server = SwitchableRedis(redis_url, mode).start()
    try:
        yield server
    finally:
        server.close()
