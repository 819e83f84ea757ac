"""A circuit breaker for Redis calls that a request waits on.

Why: a Redis that accepts connections but never answers (a blackholed path, a frozen
primary, a full network buffer) does not fail fast, it times out.  Without a breaker every
request pays that timeout on every call, so an outage of an optional dependency turns into
seconds of added latency for every client.  With one, the first failure opens the breaker;
while it is open calls are not tried at all (the caller falls back at once, costing
microseconds) and one background probe (``PING``) per backoff checks whether Redis is back.
The backoff starts at ``backoff_s`` and doubles up to ``backoff_max_s``; the first probe
that answers within ``timeout_s`` closes the breaker and runs the ``on_close`` hooks (e.g.
cleaning up what calls lost while it was open).

Requests never probe: there is no half-open state in which a client's request is the
test, so a slow Redis cannot add latency to more than the calls already in flight when it
failed (each bounded by ``timeout_s``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.tasks import cancel_and_wait

log = logging.getLogger("prefix_gateway.state")

T = TypeVar("T")


class BreakerOpen(RuntimeError):
    """The call was not tried: the breaker is open (Redis failed recently)."""


@dataclass
class BreakerStats:
    """Counters for ``/admin/stats`` and ``/metrics``."""

    trips: int = 0  # closed -> open transitions
    failures: int = 0  # calls that raised or timed out
    skipped: int = 0  # calls not tried because the breaker was open
    probes: int = 0  # background PINGs sent while open
    closes: int = 0  # open -> closed transitions (a probe answered)


class Breaker:
    """Open after a failed call; closed again by a background probe that answers in time."""

    def __init__(
        self,
        name: str,
        probe: Callable[[], Awaitable[Any]],
        *,
        timeout_s: float = 0.05,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.backoff_max_s = max(backoff_s, backoff_max_s)
        self.stats = BreakerStats()
        self.on_close: list[Callable[[], None]] = []
        self._probe = probe
        self._sleep = sleep  # injectable: tests check the backoff without waiting it out
        self._open_since: float | None = None
        self._prober: asyncio.Task[None] | None = None
        self._last_error = ""

    @property
    def is_open(self) -> bool:
        return self._open_since is not None

    async def call(self, make: Callable[[], Awaitable[T]]) -> T:
        """``await make()`` bounded by ``timeout_s``; raises :class:`BreakerOpen` without calling
        when open, and the call's own error (``TimeoutError`` past the bound) after tripping."""
        if self._open_since is not None:
            self.stats.skipped += 1
            raise BreakerOpen(f"{self.name}: Redis skipped for now ({self._last_error})")
        try:
            async with asyncio.timeout(self.timeout_s):
                return await make()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failed(exc)
            raise

    def failed(self, exc: BaseException) -> None:
        """A call failed (also for callers that bound a call themselves): open, start probing."""
        self.stats.failures += 1
        if self._open_since is not None:
            return
        self._open_since = time.monotonic()
        self._last_error = f"{type(exc).__name__}: {exc}"[:200] if str(exc) else type(exc).__name__
        self.stats.trips += 1
        log.warning(
            "%s: Redis failed (%s); skipping it, probing every %.2g-%.3g s",
            self.name,
            self._last_error,
            self.backoff_s,
            self.backoff_max_s,
        )
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not in a loop (tests): nothing will probe, stays open
            return
        if self._prober is None or self._prober.done():
            self._prober = loop.create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        backoff = self.backoff_s
        while True:
            await self._sleep(backoff)
            self.stats.probes += 1
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._probe()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._last_error = f"{type(exc).__name__}: {exc}"[:200] if str(exc) else type(exc).__name__
                backoff = min(backoff * 2, self.backoff_max_s)
                continue
            break
        opened = self._open_since or time.monotonic()
        self._open_since = None
        self.stats.closes += 1
        log.info("%s: Redis answers again after %.1f s; using it", self.name, time.monotonic() - opened)
        for hook in list(self.on_close):
            try:
                hook()
            except Exception:  # a hook's bug must not keep the breaker open
                log.exception("%s: a breaker close hook failed", self.name)

    async def stop(self) -> None:
        if self._prober is not None:
            await cancel_and_wait(self._prober)
            self._prober = None

    def snapshot(self) -> dict[str, Any]:
        open_for = time.monotonic() - self._open_since if self._open_since is not None else None
        return {
            "state": "open" if open_for is not None else "closed",
            "open_for_s": round(open_for, 3) if open_for is not None else None,
            "timeout_ms": round(self.timeout_s * 1000, 3),
            "last_error": self._last_error or None,
            **self.stats.__dict__,
        }
