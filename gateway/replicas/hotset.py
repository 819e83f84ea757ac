"""The hottest prefixes routed to one replica, with the body to replay for each (warm restarts).

A replica that restarts comes back with an empty prefix cache; the gateway can replay the
prompts it had been sending there (:mod:`gateway.replicas.warmup`).  This module is the
memory behind that: per (route, replica), a bounded map from a *prefix identity* to the
latest request body with that prefix and its hotness.

- **Identity**: the request's session header value when it has one (a conversation: its
  latest body carries its whole history), else the chain key of the prompt's first
  ``key_tokens`` tokens (a tenant's system prompt, a shared document).  Replaying the latest
  body warms that head *and* whatever followed it last time.
- **Hotness**: requests weighted by recency — each request adds ``2^(t / half_life)``, so a
  score is a count that halves every ``half_life_s`` without touching every entry on every
  tick (scores are rescaled now and then to stay finite).
- **Bounds**: at most ``max_prefixes`` entries and ``max_bytes`` of bodies.  When a new
  entry would break either, the coldest entries are dropped down to 3/4 of both bounds
  (one sort per many inserts, not a scan per insert).  A body larger than ``max_bytes / 4``
  is never kept: it would push out many hot ones.

Bodies hold prompt text: they are kept only while ``warm_restart.enabled`` and never logged.
Plain data, no I/O, no clock of its own (callers pass ``now``), so it is tested directly.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

#: rescale scores when the exponent grows past this (2^64 keeps float precision comfortable)
_RESCALE_AT = 64.0
#: after a prune the set holds at most this share of each bound
_PRUNE_TO = 0.75


@dataclass(slots=True)
class HotPrefix:
    """One remembered prefix: the latest body that carried it, and how hot it is."""

    endpoint: str  # "chat" | "completions"
    body: bytes  # as last sent upstream (rewritten for the replay only when it is replayed)
    score: float  # recency-weighted request count, in the set's current scale
    requests: int  # plain count, for /admin/stats and tests
    last_seen: float


class HotSet:
    """Bounded, recency-weighted hot prefixes of one (route, replica)."""

    def __init__(self, max_prefixes: int, max_bytes: int, half_life_s: float) -> None:
        self.max_prefixes = max_prefixes
        self.max_bytes = max_bytes
        self.half_life_s = half_life_s
        self.entries: dict[Hashable, HotPrefix] = {}
        self.bytes = 0
        self.dropped = 0  # entries pruned as the coldest
        self.refused = 0  # bodies too large to keep
        self._epoch: float | None = None  # the time at which a weight is 1

    def __len__(self) -> int:
        return len(self.entries)

    def resize(self, max_prefixes: int, max_bytes: int, half_life_s: float) -> None:
        """New bounds (a config reload); shrinking prunes at once.  Scores are kept as they are:
        a new half-life only changes the weight of requests from now on."""
        self.max_prefixes, self.max_bytes, self.half_life_s = max_prefixes, max_bytes, half_life_s
        if len(self.entries) > max_prefixes or self.bytes > max_bytes:
            self._prune()

    def _weight(self, now: float) -> float:
        if self._epoch is None:
            self._epoch = now
        exponent = (now - self._epoch) / self.half_life_s
        if exponent > _RESCALE_AT:
            factor = 2.0**-exponent
            for entry in self.entries.values():
                entry.score *= factor
            self._epoch = now
            exponent = 0.0
        return 2.0**exponent

    def touch(self, key: Hashable, endpoint: str, body: bytes, now: float) -> bool:
        """Count a request of prefix ``key`` whose body was ``body``; False if the body is too large."""
        size = len(body)
        if size * 4 > self.max_bytes:
            self.refused += 1
            return False
        weight = self._weight(now)
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = HotPrefix(endpoint, body, weight, 1, now)
            self.bytes += size
            if len(self.entries) > self.max_prefixes or self.bytes > self.max_bytes:
                self._prune()
            return True
        self.bytes += size - len(entry.body)
        entry.endpoint, entry.body = endpoint, body
        entry.score += weight
        entry.requests += 1
        entry.last_seen = now
        if self.bytes > self.max_bytes:
            self._prune()
        return True

    def _prune(self) -> None:
        """Drop the coldest entries down to 3/4 of both bounds."""
        keep_count = max(1, int(self.max_prefixes * _PRUNE_TO))
        keep_bytes = int(self.max_bytes * _PRUNE_TO)
        ranked = sorted(self.entries.items(), key=lambda item: item[1].score, reverse=True)
        kept: dict[Hashable, HotPrefix] = {}
        total = 0
        for key, entry in ranked:
            if len(kept) >= keep_count:
                break
            size = len(entry.body)
            if total + size > keep_bytes:
                continue  # a smaller, colder one may still fit
            kept[key] = entry
            total += size
        self.dropped += len(self.entries) - len(kept)
        self.entries, self.bytes = kept, total

    def hottest(self, n: int) -> list[HotPrefix]:
        """The ``n`` hottest prefixes, hottest first (ties: the most recently seen first)."""
        ranked = sorted(self.entries.values(), key=lambda e: (e.score, e.last_seen), reverse=True)
        return ranked[:n]

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
        self._epoch = None
