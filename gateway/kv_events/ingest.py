"""Apply decoded event batches to the precise index, in sequence, from any source.

The ZMQ subscriber calls this for every message; the virtual-clock benchmark calls it with
the simulator's events through a callback, without sockets (contract §5).  Sequence rules
are :mod:`gateway.kv_events.feeds`'; a gap is reported to a caller that can replay it
(``on_gap="report"``), else the replica's entries are dropped and relearned from here on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from gateway.kv_events.decoder import AllBlocksCleared, Event
from gateway.kv_events.feeds import Feed
from gateway.kv_events.index import PreciseIndex


class Ingestor:
    """The precise index plus each replica's feed state."""

    def __init__(self, index: PreciseIndex, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.feeds: dict[str, Feed] = {}
        self.clock = clock
        # bumped when a feed is first heard or starts a new connection: a mode may have changed
        # before its staleness would say so, and the live set is looked at again (PreciseRouting.live)
        self.modes_epoch = 0

    def feed(self, name: str) -> Feed:
        """``name``'s feed, created (and its index slot added) on first use."""
        feed = self.feeds.get(name)
        if feed is None:
            feed = self.feeds[name] = Feed(name)
            self.index.add(name)
        return feed

    def forget(self, name: str) -> None:
        self.feeds.pop(name, None)
        self.index.forget(name)

    def ingest(
        self,
        name: str,
        dp_rank: int,
        seq: int,
        events: Sequence[Event],
        *,
        now: float | None = None,
        on_gap: str = "clear",
    ) -> str:
        """Apply one batch; returns its verdict (``first``/``next``/``gap``/``restart``).

        ``on_gap="report"``: a gap is returned unapplied (the caller replays the missing
        batches, then calls again, or calls :meth:`resync`); ``"clear"``: the replica's
        entries are dropped and this batch applied (what is missing is relearned).
        """
        feed = self.feed(name)
        verdict = feed.check(dp_rank, seq)
        if verdict == "gap":
            if on_gap == "report":
                return verdict
            feed.gaps += 1
            self._clear(feed, lost=False)
        elif verdict == "restart":
            feed.restarts += 1
            feed.fresh_since = time.monotonic()  # real time: compared with scrape times
            self._clear(feed)
        self._apply(feed, dp_rank, seq, events, now)
        return verdict

    def resync(self, name: str, dp_rank: int, seq: int, events: Sequence[Event], *, now: float | None = None) -> None:
        """A gap that could not be replayed: drop the replica's entries, apply this batch."""
        feed = self.feed(name)
        feed.gaps += 1
        self._clear(feed, lost=False)
        self._apply(feed, dp_rank, seq, events, now)

    def _apply(self, feed: Feed, dp_rank: int, seq: int, events: Sequence[Event], now: float | None) -> None:
        if not feed.heard:
            self.modes_epoch += 1
        self.index.apply(feed.name, events)
        feed.events += len(events)
        feed.clears += sum(1 for event in events if isinstance(event, AllBlocksCleared))
        feed.heard_at(dp_rank, seq, self.clock() if now is None else now)

    def _clear(self, feed: Feed, lost: bool = True) -> None:
        feed.clears += 1
        self.index.clear(feed.name, lost)

    def new_stream(self, name: str) -> None:
        """``name``'s engine ended or restarted (its publisher disconnected, its counters went
        back): its entries are dropped and its next message starts a new stream on every rank."""
        feed = self.feeds.get(name)
        if feed is None:
            self.index.clear(name)
            return
        feed.last_seq.clear()
        self._clear(feed)
