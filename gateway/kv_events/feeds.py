"""Each replica's event feed: sequence numbers per data-parallel rank, liveness and counters.

vLLM numbers each rank's messages 0, 1, 2, ... (one per scheduler step that changed the
cache) and starts again at 0 when the engine restarts.  So per (replica, rank):

- ``seq == last + 1``: in order;
- ``seq > last + 1``: a **gap** (the PUB drops silently over its high-water mark, or the
  connection blinked): the caller replays it over the replica's replay socket when it has
  one, else that replica's entries are dropped and relearned;
- ``seq <= last``: a **restart** (the sequence went backwards): the engine's cache is empty.

A replica is in **precise** mode while its feed is live: it has been heard since the
gateway subscribed, and no request routed there has gone ``stale_s`` without any event
following (vLLM sends no heartbeat, so silence is only suspicious while it serves traffic).
Otherwise it is routed by the approximate model, with the reason shown in stats, metrics,
explain and the doctor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.kv_events.decoder import DROP_REASONS

#: Why a replica is routed by the approximate model (metric/stat labels, bounded).
APPROXIMATE_REASONS = ("disabled", "no_events_yet", "stale", "block_size_mismatch", "not_subscribed")
VERDICTS = ("first", "next", "gap", "restart")


@dataclass(slots=True)
class Feed:
    """One replica's feed: what the subscriber saw and whether routing may trust it."""

    name: str
    subscribed: bool = False  # a subscription (or the collector's topic) is set up for it
    heard: bool = False  # some message arrived since it was (re)subscribed
    last_event_at: float | None = None  # monotonic time of the last message
    pending_since: float | None = None  # first request routed there since the last message
    endpoints: list[str] = field(default_factory=list)
    replay_endpoints: list[str] = field(default_factory=list)
    source: str = ""  # discovery | config | collector | in-process
    error: str | None = None  # the last subscription error (e.g. /kv_event_sources unreachable)
    last_seq: dict[int, int] = field(default_factory=dict)  # per data-parallel rank
    messages: int = 0
    events: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    gaps: int = 0
    replays: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})
    restarts: int = 0
    disconnects: int = 0  # the publisher's connection dropped (its engine ended): entries cleared
    clears: int = 0  # entries dropped: AllBlocksCleared, restarts, unreplayed gaps
    #: monotonic time the feed last began a new engine's stream (its publisher disconnected, or its
    #: sequence went back): what it learned since is the new engine's (see KvEvents.notice_restarts)
    fresh_since: float | None = None

    def check(self, rank: int, seq: int) -> str:
        """The verdict on ``seq`` for ``rank`` (one of :data:`VERDICTS`); nothing changes."""
        last = self.last_seq.get(rank)
        if last is None:
            return "first"
        if seq == last + 1:
            return "next"
        return "gap" if seq > last else "restart"

    def heard_at(self, rank: int, seq: int, now: float) -> None:
        self.last_seq[rank] = seq
        self.heard = True
        self.last_event_at = now
        self.pending_since = None
        self.messages += 1

    def routed(self, now: float) -> None:
        """A request that will store new blocks was sent there: events should follow."""
        if self.pending_since is None:
            self.pending_since = now

    def mode(self, now: float, stale_s: float) -> tuple[str, str | None]:
        """("precise", None) or ("approximate", reason)."""
        if not self.subscribed:
            return "approximate", "not_subscribed"
        if not self.heard:
            return "approximate", "no_events_yet"
        if self.pending_since is not None and now - self.pending_since > stale_s:
            return "approximate", "stale"
        return "precise", None

    def resubscribed(self) -> None:
        """A new connection: earlier sequence numbers say nothing about the new stream."""
        self.heard = False
        self.pending_since = None
        self.last_seq.clear()

    def as_dict(self, now: float, stale_s: float) -> dict[str, object]:
        mode, reason = self.mode(now, stale_s)
        return {
            "mode": mode,
            "reason": reason,
            "source": self.source,
            "endpoints": list(self.endpoints),
            "replay_endpoints": list(self.replay_endpoints),
            "last_event_age_s": None if self.last_event_at is None else round(now - self.last_event_at, 3),
            "messages": self.messages,
            "events": self.events,
            "dropped": {k: v for k, v in self.dropped.items() if v},
            "gaps": self.gaps,
            "replays": dict(self.replays),
            "restarts": self.restarts,
            "disconnects": self.disconnects,
            "clears": self.clears,
            "error": self.error,
        }
