"""Per-API-key concurrency and token-bucket rate limits, in one process or shared via Redis.

The key is the validated API key's identity, or the client's address when auth is off
(:mod:`.identity`).  A request first takes a token from its key's bucket
(``per_key_requests_per_s`` refill, ``per_key_burst`` capacity), then a concurrency slot
(``per_key_concurrency``); either refusal is OpenAI's 429 with ``retry-after``.

With ``state.backend: redis`` both live in Redis (one atomic script per check, see
:mod:`.shared`), so N gateway pods enforce one limit, not N.  When Redis fails, the check
falls back to this process's own tables (each pod then enforces the limit on its share)
rather than refusing or waving through everything.  Every Redis call goes through a
circuit breaker (:mod:`gateway.state.breaker`): each is bounded by ``limits.redis_timeout_ms``
(50 ms by default), and after a failure Redis is not tried again until a background PING
answers, so a blackholed Redis costs a request at most one timeout, and nothing once the
breaker is open.

A slot whose acquire reply was lost (timed out or cut: the script may have run) or whose
release could not be sent is not left to its lease (``limits.concurrency_lease_s``, 15 min):
its token is remembered (up to ``MAX_ORPHANS``) and removed as soon as the breaker closes.
Why this and not a short lease renewed while the request runs: renewal costs a Redis
round trip per request per renewal period even when nothing fails, and a renewal that
fails mid-stream would have to cut a healthy request or let the slot lapse; the cleanup
costs nothing until something is lost, and then one pipelined ``ZREM`` batch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import RateLimited
from gateway.limits.local import MAX_KEYS, LocalBuckets, LocalSlots
from gateway.limits.shared import RedisLimits
from gateway.state.breaker import Breaker, BreakerOpen
from gateway.tasks import cancel_and_wait

log = logging.getLogger("prefix_gateway.limits")

MAX_ORPHANS = 10_000  # lost slots remembered for cleanup; beyond, the oldest wait for their lease
_CLEANUP_BATCH = 500  # ZREMs per pipelined round trip
_CLEANUP_TIMEOUT_S = 1.0  # one batch's bound (off the request path: a batch may take longer than a check)


@dataclass(slots=True)
class Ticket:
    """A held concurrency slot (``release`` gives it back)."""

    key: str
    token: str
    shared: bool


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
        redis_timeout_s: float = 0.05,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self.concurrency = concurrency
        self.rate = requests_per_s
        self.burst = float(burst or max(1, round(requests_per_s)))
        self.enabled = concurrency > 0 or requests_per_s > 0
        self.buckets = LocalBuckets(requests_per_s, self.burst, max_keys) if requests_per_s > 0 else None
        self.slots = LocalSlots(concurrency) if concurrency > 0 else None
        self.redis_url = redis_url
        self.prefix = prefix
        self.lease_s = lease_s
        self.shared: RedisLimits | None = None
        self.fallbacks = 0  # checks answered locally because Redis failed or the breaker was open
        self.refused = {"rate": 0, "concurrency": 0}
        self.orphans_freed = 0  # lost slots removed from Redis once it answered again
        self.orphans_dropped = 0  # lost slots past MAX_ORPHANS (their lease frees them)
        self._orphans: OrderedDict[tuple[str, str], None] = OrderedDict()  # (key, token)
        self._client: Any = None
        self._background: set[asyncio.Task[None]] = set()
        self._cleanup: asyncio.Task[None] | None = None
        self._warming: asyncio.Task[None] | None = None
        self.breaker: Breaker | None = None
        if self.enabled and redis_url:
            self.breaker = Breaker(
                "limits", self._ping, timeout_s=redis_timeout_s, backoff_s=backoff_s, backoff_max_s=backoff_max_s
            )
            self.breaker.on_close.append(self._schedule_cleanup)

    async def start(self) -> None:
        if self.breaker is None or not self.redis_url:
            return
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        from gateway.state.redis_client import open_redis

        # no retries inside redis-py: the breaker decides when Redis is tried again; the socket
        # timeouts are only a backstop (every call is bounded by the breaker's timeout)
        self._client = open_redis(self.redis_url, connect_timeout_s=1.0, timeout_s=1.0, retry=Retry(NoBackoff(), 0))
        self.shared = RedisLimits(self._client, self.prefix, self.lease_s)
        # warm up in the background (a Redis outage must not delay the start): a connection in
        # the pool and the scripts loaded, so the first requests' checks fit their short bound
        self._warming = asyncio.get_running_loop().create_task(self._warm_up(self.shared, self.breaker))

    async def _warm_up(self, shared: RedisLimits, breaker: Breaker) -> None:
        try:
            async with asyncio.timeout(_CLEANUP_TIMEOUT_S):
                await self._ping()
                await shared.load_scripts()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._unsupported(exc):
                return
            breaker.failed(exc)  # not reachable: start open, probing (requests never wait for it)

    async def stop(self) -> None:
        if self.breaker is not None:
            await self.breaker.stop()
        await cancel_and_wait(self._cleanup, self._warming)
        for task in list(self._background):
            await asyncio.gather(task, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
            self.shared = None

    async def _ping(self) -> None:
        if self._client is not None:
            await self._client.ping()

    def _unsupported(self, exc: BaseException) -> bool:
        """A server without scripting (the --workers local broker): per-process limits for good."""
        if type(exc).__name__ == "ResponseError" and "unknown command" in str(exc).lower():
            if self.shared is not None:
                log.info("limits: the state server cannot run the limit scripts; limits are per process")
            self.shared = None
            self._orphans.clear()  # it holds no slots (and knows no ZREM): nothing to free there
            return True
        return False

    def _redis_failed(self, exc: BaseException) -> None:
        self._unsupported(exc)
        self.fallbacks += 1

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
        shared, breaker = self.shared, self.breaker
        if shared is not None and breaker is not None:
            try:
                return await breaker.call(lambda: shared.take(key, self.rate, self.burst))
            except Exception as exc:  # any Redis failure (or the breaker open): fall back, never 500
                self._redis_failed(exc)
        return self.buckets.take(key, time.monotonic())

    async def _acquire(self, key: str) -> Ticket | None:
        assert self.slots is not None
        shared, breaker = self.shared, self.breaker
        if shared is not None and breaker is not None:
            token = os.urandom(12).hex()
            try:
                ok = await breaker.call(lambda: shared.acquire(key, self.concurrency, token))
            except BreakerOpen as exc:
                self._redis_failed(exc)
            except Exception as exc:
                # sent, but no (usable) reply: the script may have taken the slot
                self._orphan(key, token)
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
        assert self.breaker is not None
        try:
            await self.breaker.call(lambda: shared.release(ticket.key, ticket.token))
        except Exception as exc:  # removed when Redis answers again (the lease is the last resort)
            self._orphan(ticket.key, ticket.token)
            self._redis_failed(exc)

    # -- lost slots ----------------------------------------------------------------------
    def _orphan(self, key: str, token: str) -> None:
        self._orphans[(key, token)] = None
        if len(self._orphans) > MAX_ORPHANS:
            self._orphans.popitem(last=False)
            self.orphans_dropped += 1
        if self.breaker is not None and not self.breaker.is_open:
            self._schedule_cleanup()  # e.g. a release that raised without tripping

    def _schedule_cleanup(self) -> None:
        if not self._orphans or (self._cleanup is not None and not self._cleanup.done()):
            return
        self._cleanup = asyncio.get_running_loop().create_task(self._free_orphans())

    async def _free_orphans(self) -> None:
        """ZREM every remembered lost slot, in pipelined batches; a failure trips the breaker
        and leaves the rest for its next close."""
        while self._orphans and self._client is not None and self.breaker is not None and self.shared is not None:
            batch = list(self._orphans)[:_CLEANUP_BATCH]
            try:
                async with asyncio.timeout(_CLEANUP_TIMEOUT_S):
                    pipe = self._client.pipeline(transaction=False)
                    for key, token in batch:
                        pipe.zrem(f"{self.prefix}conc:{key}", token)
                    removed = await pipe.execute()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.breaker.failed(exc)
                return
            for entry in batch:
                self._orphans.pop(entry, None)
            self.orphans_freed += sum(int(n) for n in removed)  # 0 for a slot the script never took

    def snapshot(self) -> Mapping[str, Any]:
        return {
            "shared": self.shared is not None,
            "refused": dict(self.refused),
            "redis_fallbacks": self.fallbacks,
            "local_buckets": len(self.buckets) if self.buckets is not None else 0,
            "lost_slots": {"pending": len(self._orphans), "freed": self.orphans_freed, "dropped": self.orphans_dropped},
            "redis_breaker": self.breaker.snapshot() if self.breaker is not None else None,
        }
