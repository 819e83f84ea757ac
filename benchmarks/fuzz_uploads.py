"""Slow and oversize uploads, many at once, for the fuzz benchmark (issue 25, item 3).

Before the process-wide caps, every request could hold ``server.max_body_bytes`` while its
body trickled in, and nothing bounded how many did: a thousand slow uploads are gigabytes.
This family opens ``clients`` connections at once, of these kinds:

- **trickle**: a small valid chat body, a few bytes every 10 ms (Content-Length, or chunked);
- **stall**: a head declaring a body just under the size limit, 16 bytes of it, then nothing
  (the body timeout ends it: 408; or the declared bytes do not fit: 503 at once);
- **bulk**: 4 MiB declared (or chunked; at most half the size limit), 7/8 of it sent at
  once, then nothing: real bytes held by the gateway until its body timeout;
- **oversize**: a Content-Length over the size limit, or absurd: 413 before any byte is read;

while a probe polls ``/health`` and a well-behaved client sends small chat requests.  Every
answer is judged by :class:`~benchmarks.fuzz_cases.Tally` (503 ``server_overloaded`` with
``retry-after`` is an intended shed, any other 5xx a failure); probes must all answer 200.
The caller samples the gateway's RSS around it (``benchmarks.procstat.RssSampler``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from typing import Any

import httpx

from benchmarks.fuzz_cases import MODEL, PATHS, Tally

BULK_DECLARED = 4 * 1024 * 1024
_SMALL = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "slowly " * 20}], "max_tokens": 2})
SMALL = _SMALL.encode()
_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def bulk_declared(max_body_bytes: int) -> int:
    """What a bulk upload declares: 4 MiB, or half the size limit when that is smaller."""
    return min(BULK_DECLARED, max_body_bytes // 2)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def plans(clients: int, max_body_bytes: int) -> list[tuple[str, bytes, list[tuple[float, bytes]]]]:
    """(kind, head, [(delay before, bytes)]) for ``clients`` uploads, the kinds interleaved."""
    declared = bulk_declared(max_body_bytes)
    bulk = b" " * (declared * 7 // 8)
    kinds: list[tuple[str, bytes, list[tuple[float, bytes]]]] = [
        (
            "trickle",
            _HEAD + b"Content-Length: %d\r\n\r\n" % len(SMALL),
            [(0.01, SMALL[i : i + 4]) for i in range(0, len(SMALL), 4)],
        ),
        (
            "trickle chunked",
            _HEAD + b"Transfer-Encoding: chunked\r\n\r\n",
            [(0.01, _chunk(SMALL[i : i + 4])) for i in range(0, len(SMALL), 4)] + [(0.01, b"0\r\n\r\n")],
        ),
        (
            "trickle",
            _HEAD + b"Content-Length: %d\r\n\r\n" % len(SMALL),
            [(0.01, SMALL[i : i + 4]) for i in range(0, len(SMALL), 4)],
        ),
        ("stall", _HEAD + b"Content-Length: %d\r\n\r\n" % (max_body_bytes - 1), [(0.0, b'{"model":"demo-m')]),
        ("bulk", _HEAD + b"Content-Length: %d\r\n\r\n" % declared, [(0.0, bulk)]),
        (
            "bulk chunked",
            _HEAD + b"Transfer-Encoding: chunked\r\n\r\n",
            [(0.0, b"".join(_chunk(bulk[i : i + 65536]) for i in range(0, len(bulk), 65536)))],
        ),
        ("oversize", _HEAD + b"Content-Length: %d\r\n\r\n" % (max_body_bytes + 1), []),
        ("absurd length", _HEAD + b"Content-Length: 1000000000000000\r\n\r\n", []),
    ]
    return [kinds[i % len(kinds)] for i in range(clients)]


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split(" ", 2)[1]), headers, body


async def _upload(
    host: str, port: int, head: bytes, pieces: list[tuple[float, bytes]], hold_s: float
) -> tuple[int | None, dict[str, str], bytes]:
    """Send ``head`` and ``pieces`` (stopping once answered); the answer, or None after ``hold_s``."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return None, {}, b""

    async def send() -> None:
        writer.write(head)
        for delay, data in pieces:
            if delay:
                await asyncio.sleep(delay)
            for i in range(0, len(data), 65536):
                writer.write(data[i : i + 65536])
                await writer.drain()

    sender = asyncio.create_task(send())
    try:
        async with asyncio.timeout(hold_s):
            return await _read_answer(reader)
    except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
        return None, {}, b""
    finally:
        sender.cancel()
        with contextlib.suppress(BaseException):
            await sender
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _probe(base_url: str, stop: asyncio.Event, out: Counter[str]) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        while not stop.is_set():
            try:
                out[str((await client.get("/health")).status_code)] += 1
            except httpx.HTTPError as exc:
                out[type(exc).__name__] += 1
            await asyncio.sleep(0.05)


async def _normal(base_url: str, stop: asyncio.Event, tally: Tally) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        while not stop.is_set():
            try:
                r = await client.post(PATHS["chat"], content=SMALL, headers={"content-type": "application/json"})
                tally.judge("upload neighbour", r.status_code, r.headers.get("content-type", ""), r.content, r.headers)
            except httpx.HTTPError as exc:
                tally.judge(f"upload neighbour ({type(exc).__name__})", None, "", b"")
            await asyncio.sleep(0.05)


async def _run(
    host: str,
    port: int,
    base_url: str,
    clients: int,
    max_body_bytes: int,
    hold_s: float,
    tally: Tally,
    neighbours: Tally,
) -> dict[str, Any]:
    stop = asyncio.Event()
    probes: Counter[str] = Counter()
    side = [
        asyncio.create_task(_probe(base_url, stop, probes)),
        asyncio.create_task(_normal(base_url, stop, neighbours)),
    ]
    todo = plans(clients, max_body_bytes)
    t0 = time.monotonic()
    answers = await asyncio.gather(*(_upload(host, port, head, pieces, hold_s) for _, head, pieces in todo))
    elapsed = time.monotonic() - t0
    stop.set()
    await asyncio.gather(*side)
    by_kind: dict[str, Counter[str]] = {}
    for (kind, _, _), (status, headers, body) in zip(todo, answers, strict=True):
        tally.judge(f"upload {kind}", status, headers.get("content-type", ""), body, headers)
        by_kind.setdefault(kind, Counter())[str(status)] += 1
    bulk = sum(1 for kind, _, _ in todo if kind.startswith("bulk"))
    return {
        "clients": clients,
        "statuses_by_kind": {k: dict(sorted(c.items())) for k, c in by_kind.items()},
        "health_probes": dict(probes),
        "health_probes_failed": sum(v for k, v in probes.items() if k != "200"),
        "bulk_bytes_sent": bulk * (bulk_declared(max_body_bytes) * 7 // 8),
        "elapsed_s": round(elapsed, 1),
    }


def run_uploads(
    host: str,
    port: int,
    base_url: str,
    clients: int,
    max_body_bytes: int,
    hold_s: float,
    tally: Tally,
    neighbours: Tally,
) -> dict[str, Any]:
    """``clients`` concurrent uploads (see the module docstring); each waits up to ``hold_s`` for its answer."""
    return asyncio.run(_run(host, port, base_url, clients, max_body_bytes, hold_s, tally, neighbours))
