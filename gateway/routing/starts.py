"""How many replicas a shared head needs: its share of new conversations.

A conversation stays on the replica that holds its history for every later turn, so where
new conversations *start* commits the fleet's load for minutes.  Behind a long shared head
(an agent tenant's system prompt and tool schemas) every replica holding the head is the
cheapest place to start: the head is cached there.  If one tenant's head draws most new
conversations, its first holder takes them all until the in-flight bound pushes *turns*
off their history; if it draws a fair share, it should stay on one replica (copying a
6-12k-token head to every replica costs prefill and KV space that histories need: measured,
2-5 points of hit rate).

So each shared head (a fork key: a prefix other prompts went on from differently) is an item
with a load — its share of the pool's recent conversation starts — and gets as many holders
as that load needs: ``round(share x n / factor)`` (``factor`` 1: one holder per replica's
fair share of starts), the consistent-hashing-with-bounded-loads idea applied to heads.  While it has fewer and every
holder is busy, a new conversation starts on another replica, which computes the head and
holds it from then on.  A tenant among several keeps one holder; a single tenant's burst
spreads over the fleet; an idle holder keeps one-at-a-time traffic (nothing to gain).

Starts decay geometrically (``window`` recent starts weigh ~1/e), lazily, in O(1)
(:mod:`gateway.routing.decay`).  Heads are kept in an LRU of bounded size.

Several gateway processes share their starts (``gateway.state.affinity_sync``): each one's
local starts go to its sink (:mod:`gateway.routing.sinks`) and its peers' come back through ``record_peer``, so every
process judges a head by the fleet's starts, not by the third of them it placed itself; a
process that joins takes its peers' counts from their catch-up snapshot (``export``/``merge``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from gateway.routing.decay import DecayedCounts, Token
from gateway.routing.sinks import NO_SINK, StartSink


class HeadDemand(DecayedCounts):
    """Recent new conversations behind shared heads, in total and per head (decayed; heads in
    an LRU of ``max_heads``).

    Only requests starting behind a shared head count: a request sharing nothing has no head
    to copy (it goes to the least busy replica), and counting it would make every head look
    rarer than it is among the conversations that could pile up.
    """

    __slots__ = ("_max_heads", "_sink")

    def __init__(self, window: int, max_heads: int = 8192) -> None:
        super().__init__(window)
        self._max_heads = max_heads
        self._sink: StartSink = NO_SINK  # hears each local start (shared state; see attach_sink)

    @property
    def sink(self) -> StartSink:
        """Where local starts go (:data:`~gateway.routing.sinks.NO_SINK` when not shared)."""
        return self._sink

    def attach_sink(self, sink: StartSink) -> None:
        """Send every later local start to ``sink`` (``NO_SINK``: stop sharing).

        A method, not a constructor argument, for the affinity index's reason
        (:meth:`gateway.routing.affinity.AffinityIndex.attach_sink`): the policy builds the
        counts, the state sync comes later and outlives the routes it shares.
        """
        self._sink = sink

    def recent_starts(self) -> float:
        """Recent starts in the pool (decayed: the newest weighs 1)."""
        return self.total()

    def share(self, head: int, prior: float) -> float:
        """``head``'s share of recent starts, counting the one being placed.

        ``prior``: the share is taken over at least this many starts, so a fresh pool (two
        of its first three starts behind one head) does not copy heads on noise.
        """
        return (self.count(head) + 1.0) / max(self.total() + 1.0, prior)

    def holders_needed(self, head: int, replicas: int, factor: float, prior: float) -> int:
        """How many replicas ``head`` needs: its share of starts in replicas, ``share x
        replicas / factor``, rounded to the nearest (at least 1).  Rounding, not the ceiling:
        a tenant with 30 % of new conversations on 4 replicas (1.2) keeps one holder, a
        single tenant's burst (share near 1) gets all 4."""
        return max(1, math.floor(self.share(head, prior) * replicas / factor + 0.5))

    def record(self, head: int) -> Token:
        """Count a start behind ``head``; returns the undo token."""
        token = self.record_peer(head)
        self._sink.started(head)
        return token

    def record_peer(self, head: int) -> Token:
        """Count a start another gateway process placed (not passed on to the sink)."""
        token = self._add(head, 1.0)
        self._bound()
        return token

    def _bound(self) -> None:
        """Keep the ``max_heads`` most recently started heads (LRU)."""
        while len(self._counts) > self._max_heads:
            self._counts.popitem(last=False)

    def export(self, top: int) -> tuple[float, list[tuple[int, float]]]:
        """Recent starts and the ``top`` most recently started heads' counts (decayed, the newest
        start weighing 1), oldest first: what ``merge`` takes."""
        unit = self._increment
        heads = list(self._counts.items())[-top:] if top > 0 else []
        return self._total / unit, [(head, count / unit) for head, count in heads]

    def merge(self, total: float, heads: Iterable[tuple[int, float]]) -> None:
        """Take a peer's ``export`` as this process's counts (a process that has just joined).

        The larger of the two, per head and in total, not their sum: the peer counts the
        fleet's starts, and those include every start this process has heard since it
        subscribed (peers' starts arriving live before the snapshot, its own first ones),
        which a sum would count twice.
        """
        unit = self._increment
        self._total = max(self._total, max(0.0, total) * unit)
        for head, count in heads:
            self._counts[head] = max(self._counts.pop(head, 0.0), max(0.0, count) * unit)
        self._bound()

    def snapshot(self, top: int = 8) -> dict[str, object]:
        """Recent starts and the busiest heads' shares (for ``/admin/stats``; keys in hex)."""
        busiest = sorted(self._counts.items(), key=lambda kv: kv[1], reverse=True)[:top]
        return {
            "recent_starts": round(self.recent_starts(), 1),
            "busiest_heads": {f"{k:016x}": round(v / self._total, 3) for k, v in busiest if self._total},
        }
