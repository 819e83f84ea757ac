"""A tiny pub/sub broker speaking Redis's protocol on a unix socket: shared state for ``--workers``.

``prefix-gateway serve --workers N`` runs N gateway processes on one port.  With a Redis
configured they share affinity and load through it like separate pods do.  Without one, the
parent process runs this broker and points every worker's shared-state client at
``unix://<socket>``: the workers then use the very same code path (``gateway.state``) as pods
sharing a real Redis, with no second implementation of sharing to keep correct.

It implements only what that path uses — ``SUBSCRIBE``/``UNSUBSCRIBE``/``PUBLISH``/``PING``
(RESP2) — answers ``+OK`` to connection set-up commands (``CLIENT SETINFO``, ``SELECT``), a
``NOPROTO`` error to ``HELLO`` (as a RESP2-only server does: clients fall back to RESP2)
and an error to anything else (per-key limits then fall back to per-process counting, as they
do when a real Redis fails).  It stores nothing, listens only on a file-system socket
readable by the owner, and runs in the parent's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import defaultdict

log = logging.getLogger("prefix_gateway.workers")

MAX_BULK = 64 * 1024 * 1024  # larger than any batch the gateway publishes
MAX_ARGS = 1024
MAX_BUFFERED = 16 * 1024 * 1024  # per subscriber, not yet read by it


class ProtocolError(Exception):
    pass


def encode(value: object) -> bytes:
    """RESP2 encoding of the replies the broker sends."""
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if isinstance(value, str):
        return encode(value.encode())
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, list):
        return b"*%d\r\n" % len(value) + b"".join(encode(v) for v in value)
    raise TypeError(type(value))


async def read_command(reader: asyncio.StreamReader) -> list[bytes] | None:
    """One client command (an array of bulk strings, or an inline command); None at EOF."""
    line = await reader.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        return line.strip().split()  # inline command (e.g. a manual PING)
    count = int(line[1:].strip())
    if not 0 <= count <= MAX_ARGS:
        raise ProtocolError("bad array length")
    args = []
    for _ in range(count):
        header = await reader.readline()
        if not header.startswith(b"$"):
            raise ProtocolError("expected a bulk string")
        size = int(header[1:].strip())
        if not 0 <= size <= MAX_BULK:
            raise ProtocolError("bad bulk length")
        data = await reader.readexactly(size + 2)
        args.append(data[:-2])
    return args


class LocalBroker:
    """Pub/sub between the worker processes of one gateway (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.url = f"unix://{path}"
        self._channels: dict[bytes, set[asyncio.StreamWriter]] = defaultdict(set)
        self._server: asyncio.AbstractServer | None = None
        self.published = 0

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._client, self.path)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writers in self._channels.values():
                for writer in writers:
                    writer.close()
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        subscribed: set[bytes] = set()
        try:
            while (command := await read_command(reader)) is not None:
                if not command:
                    continue
                writer.write(self._execute(command, writer, subscribed))
                await writer.drain()
        except (ProtocolError, ValueError, ConnectionError, asyncio.IncompleteReadError) as exc:
            log.debug("local broker: client dropped: %s", exc)
        finally:
            for channel in subscribed:
                self._channels[channel].discard(writer)
            writer.close()

    def _execute(self, command: list[bytes], writer: asyncio.StreamWriter, subscribed: set[bytes]) -> bytes:
        name, args = command[0].upper(), command[1:]
        if name == b"PUBLISH" and len(args) == 2:
            channel, message = args
            receivers = list(self._channels.get(channel, ()))
            frame = encode([b"message", channel, message])
            for receiver in receivers:
                # a worker that stops reading loses messages (bounded buffer) instead of growing ours
                if not receiver.is_closing() and receiver.transport.get_write_buffer_size() < MAX_BUFFERED:
                    receiver.write(frame)
            self.published += 1
            return encode(len(receivers))
        if name == b"SUBSCRIBE" and args:
            out = b""
            for channel in args:
                subscribed.add(channel)
                self._channels[channel].add(writer)
                out += encode([b"subscribe", channel, len(subscribed)])
            return out
        if name == b"UNSUBSCRIBE":
            out = b""
            for channel in args or list(subscribed):
                subscribed.discard(channel)
                self._channels[channel].discard(writer)
                out += encode([b"unsubscribe", channel, len(subscribed)])
            return out
        if name == b"PING":
            return encode([b"pong", b""]) if subscribed else b"+PONG\r\n"
        if name == b"HELLO":  # a RESP2-only server's answer: the client falls back to RESP2
            return b"-NOPROTO this broker speaks RESP2 only\r\n"
        if name in (b"CLIENT", b"SELECT", b"AUTH"):
            return b"+OK\r\n"
        return b"-ERR unknown command for the gateway's local broker\r\n"
