"""Per-key token buckets and concurrency slots held in this process.

Used alone with ``state.backend: memory``, and as the fallback while Redis is unreachable
(each process then enforces the limits on its own share of the traffic).  Both tables are
bounded: the least recently used keys are forgotten first, so a flood of distinct keys
cannot grow memory without bound (a forgotten bucket simply starts full again).

Memory: a bucket costs about 280 bytes (measured with tracemalloc: the ``k:``/``a:`` key
string, a 2-float tuple and the ordered-dict entry), so the default ``limits.max_keys`` of
100,000 is about 28 MB per process at most.  Slots exist only while held (a key with no
request in flight has no entry), so that table is bounded by the requests in flight.
Keys are validated API keys or client addresses (``gateway.limits.identity``), never raw
tokens, so a client cannot mint buckets to evict others' beyond its addresses.
"""

from __future__ import annotations

import math
from collections import OrderedDict

MAX_KEYS = 100_000


class LocalBuckets:
    """Token buckets: ``rate`` tokens per second up to ``burst``; one request costs one token."""

    def __init__(self, rate: float, burst: float, max_keys: int = MAX_KEYS) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def take(self, key: str, now: float) -> float:
        """0.0 when admitted, else the seconds until a token is available."""
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens, now)
        if len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait

    def __len__(self) -> int:
        return len(self._buckets)


class LocalSlots:
    """Concurrency slots per key: at most ``limit`` held at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}

    def acquire(self, key: str) -> bool:
        held = self._held.get(key, 0)
        if held >= self.limit:
            return False
        self._held[key] = held + 1
        return True

    def release(self, key: str) -> None:
        held = self._held.get(key, 0) - 1
        if held > 0:
            self._held[key] = held
        else:
            self._held.pop(key, None)

    def held(self, key: str) -> int:
        return self._held.get(key, 0)


def retry_after_header(wait_s: float) -> bytes:
    """``retry-after`` in whole seconds, never 0 (clients treat 0 as "now" and hammer)."""
    return str(max(1, math.ceil(wait_s))).encode()
