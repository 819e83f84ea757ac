"""The one way the gateway opens a Redis client (shared state, per-key limits).

Why one place: every client needs the same two choices, and they were made twice.

- **RESP2, asked for explicitly.**  redis-py 8 opens every connection with ``HELLO 3`` (RESP3)
  unless told otherwise.  The gateway's replies are read as RESP2 shapes, the local broker of
  ``serve --workers`` speaks only RESP2, and so do older servers and some proxies; with the
  protocol left to the library, the same code saw other reply types depending on which
  redis-py a fresh install picked (a fresh CI machine got 8.x and the broker's workers never
  connected).  ``protocol=2`` behaves the same on redis-py 5 to 8 and on every server.
- **TCP keepalive**, so a silently dropped path to Redis fails calls instead of hanging them;
  it is a TCP option, which a ``unix://`` URL rejects.

Imported lazily by its callers: a memory-only gateway never loads redis.
"""

from __future__ import annotations

from typing import Any


def open_redis(url: str, *, connect_timeout_s: float, timeout_s: float, **options: Any) -> Any:
    """An asyncio Redis client for ``url`` (connections open on first use)."""
    import redis.asyncio as aioredis

    if not url.startswith("unix://"):
        options.setdefault("socket_keepalive", True)
    return aioredis.from_url(
        url, protocol=2, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s, **options
    )
