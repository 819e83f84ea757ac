"""Per-API-key concurrency and token-bucket rate limits, in one process or shared via Redis.

The key is the client's bearer token (hashed: the raw key is never kept or logged), or the
client's address when it sends none.  A request first takes a token from its key's bucket
(``per_key_requests_per_s`` refill, ``per_key_burst`` capacity), then a concurrency slot
(``per_key_concurrency``); either refusal is OpenAI's 429 with ``retry-after``.

With ``state.backend: redis`` both live in Redis (one atomic script per check, see
:mod:`.shared`), so N gateway pods enforce one limit, not N.  When Redis fails, the check
falls back to this process's own tables (each pod then enforces the limit on its share)
rather than refusing or waving through everything; the log says so once per outage.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import RateLimited
from gateway.limits.local import LocalBuckets, LocalSlots
from gateway.limits.shared import RedisLimits

log = logging.getLogger("prefix_gateway.limits")


@dataclass(slots=True)
class Ticket:
    """A held concurrency slot (``release`` gives it back)."""

    key: str
    token: str
    shared: bool


def client_key(authorization: str | None, client: Any) -> str:
    """The limit key: a hash of the bearer token, else the peer address."""
    if authorization:
        return "k:" + hashlib.sha256(authorization.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"a:{client[0]}" if client else "a:-"


class KeyLimiter:
    """Admission per key; ``enabled`` is False when no limit is configured (then never called)."""

    def __init__(
        self,
        concurrency: int,
        requests_per_s: float,
        burst: int,
        *,
        redis_url: str | None = None,
        prefix: str = "prefix-gateway:limits:",
        lease_s: float = 900.0,
    ) -> None:
        self.concurrency = concurrency
        self.rate = requests_per_s
        self.burst = float(burst or max(1, round(requests_per_s)))
        self.enabled = concurrency > 0 or requests_per_s > 0
        self.buckets = LocalBuckets(requests_per_s, self.burst) if requests_per_s > 0 else None
        self.slots = LocalSlots(concurrency) if concurrency > 0 else None
        self.redis_url = redis_url
        self.prefix = prefix
        self.lease_s = lease_s
        self.shared: RedisLimits | None = None
        self.fallbacks = 0  # checks answered locally because Redis failed
        self.refused = {"rate": 0, "concurrency": 0}
        self._client: Any = None
        self._warned_at = -1e9
        self._background: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if not self.enabled or not self.redis_url:
            return
        import redis.asyncio as aioredis

        keepalive = {} if self.redis_url.startswith("unix://") else {"socket_keepalive": True}  # TCP only
        self._client = aioredis.from_url(self.redis_url, socket_connect_timeout=1.0, socket_timeout=1.0, **keepalive)
        self.shared = RedisLimits(self._client, self.prefix, self.lease_s)

    async def stop(self) -> None:
        for task in list(self._background):
            await asyncio.gather(task, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
            self.shared = None

    def _redis_failed(self, exc: BaseException) -> None:
        if type(exc).__name__ == "ResponseError" and "unknown command" in str(exc).lower():
            # a server without scripting (the --workers local broker): per-process limits for good
            log.info("limits: the state server cannot run the limit scripts; limits are per process")
            self.shared = None
        self.fallbacks += 1
        now = time.monotonic()
        if now - self._warned_at > 30.0:
            self._warned_at = now
            log.warning("limits: Redis unavailable (%s); enforcing per-process limits meanwhile", exc)

    async def admit(self, key: str) -> Ticket | None:
        """A ticket when a concurrency slot is held (None when no concurrency limit); raises 429."""
        if self.buckets is not None:
            wait = await self._take(key)
            if wait > 0:
                self.refused["rate"] += 1
                raise RateLimited(
                    f"Rate limit reached for this API key: {self.rate:g} requests/s (burst {self.burst:g}). "
                    f"Retry in {wait:.2f} s.",
                    retry_after_s=wait,
                )
        if self.slots is None:
            return None
        ticket = await self._acquire(key)
        if ticket is None:
            self.refused["concurrency"] += 1
            raise RateLimited(
                f"Too many concurrent requests for this API key (limit {self.concurrency}).",
                retry_after_s=1.0,
                code="concurrency_limit_exceeded",
            )
        return ticket

    async def _take(self, key: str) -> float:
        assert self.buckets is not None
        if self.shared is not None:
            try:
                return await self.shared.take(key, self.rate, self.burst)
            except Exception as exc:  # any Redis failure: fall back, never 500
                self._redis_failed(exc)
        return self.buckets.take(key, time.monotonic())

    async def _acquire(self, key: str) -> Ticket | None:
        assert self.slots is not None
        if self.shared is not None:
            token = os.urandom(12).hex()
            try:
                ok = await self.shared.acquire(key, self.concurrency, token)
            except Exception as exc:
                self._redis_failed(exc)
            else:
                return Ticket(key, token, shared=True) if ok else None
        return Ticket(key, "", shared=False) if self.slots.acquire(key) else None

    def release(self, ticket: Ticket) -> None:
        """Give the slot back (never waits: a shared release runs in the background)."""
        if not ticket.shared:
            assert self.slots is not None
            self.slots.release(ticket.key)
            return
        shared = self.shared
        if shared is None:
            return
        task = asyncio.get_running_loop().create_task(self._release_shared(shared, ticket))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_shared(self, shared: RedisLimits, ticket: Ticket) -> None:
        try:
            await shared.release(ticket.key, ticket.token)
        except Exception as exc:  # the lease frees it later
            self._redis_failed(exc)

    def snapshot(self) -> Mapping[str, Any]:
        return {
            "shared": self.shared is not None,
            "refused": dict(self.refused),
            "redis_fallbacks": self.fallbacks,
        }
