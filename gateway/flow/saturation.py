"""Does a replica have room now; is a route saturated (pure functions over load signals).

Two kinds of signal, read differently:

- the gateway's own counts (requests in flight, uncached prompt tokens sent with no first
  byte yet — ours and the peers', see ``Replica.pending_prefill_tokens``) change the moment
  a request is placed, so a dispatcher that places one request after another sees each
  placement's effect before the next: these are what bound a burst.  The prefill limit
  counts the work queued *behind* the one the engine is computing now (the oldest of this
  process's open charges, ``Replica.head_prefill_tokens``): counted with it, a replica whose
  one long prompt filled the limit got its next request only at that prompt's first
  token, which joins the engine a step later — the engine's next step ran without prefill
  (on the overloaded synthetic trace, full size: 433 of 1,608 steps against 198 of 1,239
  without flow control, and TTFT p90 1.47x the route without it; 0.94x behind the head);
- the engine's scraped numbers (waiting, running, KV usage) lag by up to a scrape interval;
  they can only say "no room".  The waiting queue is dead-reckoned between scrapes: each
  answer the gateway has seen from the replica since takes one off
  (``Replica.waiting_now``), so a burst the engine has worked through stops reading as full
  before the next scrape — held at the scraped figure, the saturated RAG replay's engines
  ran dry while the gateway held their work (TTFT p90 2.7x the route without flow control,
  1.05x dead-reckoned).  A replica whose last scrape is older than
  ``scrape_stale_s`` has no room either (a scrape that keeps failing leaves the old,
  possibly idle, numbers behind) — while another replica of the route has fresh numbers.
  With none fresh the gateway is blind, not the fleet full: a /metrics that broke on every
  replica (a NetworkPolicy, a proxy in front of the engines) held every request to its TTL
  and answered 503, an outage made by a monitoring fault.  Then the stale replicas are
  judged as a replica never scraped (scraping off, or not yet) always is: on the gateway's
  counts alone.

A route is saturated when it has eligible replicas and none of them has room.  The callers pass
``now`` on the same clock as ``scraped_at`` (``time.monotonic()`` in the gateway, the
virtual clock in ``benchmarks/bench_virtual.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.flow.settings import SaturationSettings


class LoadSignals(Protocol):
    """What is known of one replica's load (see :class:`Signals`; the gateway adapts ``Replica``)."""

    @property
    def in_flight(self) -> int: ...
    @property
    def pending_prefill_tokens(self) -> int: ...
    @property
    def head_prefill_tokens(self) -> int: ...
    @property
    def waiting(self) -> float | None: ...
    @property
    def running(self) -> float | None: ...
    @property
    def kv_cache_usage(self) -> float | None: ...
    @property
    def scraped_at(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class Signals:
    """A plain :class:`LoadSignals` (tests, the virtual-clock benchmark)."""

    in_flight: int = 0
    pending_prefill_tokens: int = 0
    head_prefill_tokens: int = 0  # of pending_prefill_tokens: the prefill being computed now
    waiting: float | None = None
    running: float | None = None
    kv_cache_usage: float | None = None
    scraped_at: float | None = None  # None: never scraped


def fresh(signals: LoadSignals, limits: SaturationSettings, now: float) -> bool:
    """The replica's engine numbers can be trusted: scraped, and no longer ago than ``scrape_stale_s``."""
    scraped_at = signals.scraped_at
    return scraped_at is not None and not (limits.scrape_stale_s and now - scraped_at > limits.scrape_stale_s)


def full_reason(signals: LoadSignals, limits: SaturationSettings, now: float, blind: bool = False) -> str | None:
    """Why the replica has no room now (a short fixed word), or None when it has room.

    ``blind``: no replica of its route has fresh engine numbers (:func:`room`), so this one's
    are left out as if it had never been scraped."""
    queued = signals.pending_prefill_tokens - signals.head_prefill_tokens  # behind the prefill under way
    if limits.queued_prefill_tokens and queued >= limits.queued_prefill_tokens:
        return "queued_prefill"
    if limits.in_flight and signals.in_flight >= limits.in_flight:
        return "in_flight"
    scraped_at = signals.scraped_at
    if scraped_at is None or blind:
        return None
    if limits.scrape_stale_s and now - scraped_at > limits.scrape_stale_s:
        return "stale"
    waiting = signals.waiting
    if limits.waiting and waiting is not None and waiting >= limits.waiting:
        return "waiting"
    running = signals.running
    if limits.running and running is not None and running >= limits.running:
        return "running"
    usage = signals.kv_cache_usage
    if limits.kv_cache_usage and usage is not None and usage >= limits.kv_cache_usage:
        return "kv_cache"
    return None


def is_blind(replicas: Sequence[LoadSignals], limits: SaturationSettings, now: float) -> bool:
    """No replica of the route has fresh engine numbers: the gateway is blind, not the fleet full."""
    return not any(fresh(r, limits, now) for r in replicas)


def room(replicas: Sequence[LoadSignals], limits: SaturationSettings, now: float) -> list[str | None]:
    """Each of a route's eligible ``replicas``' :func:`full_reason` (None: it has room), stale
    scrapes judged against the route: no room while another replica's numbers are fresh,
    left out while none is (:func:`is_blind`)."""
    unseen = is_blind(replicas, limits, now)
    return [full_reason(r, limits, now, unseen) for r in replicas]


def saturated(replicas: Sequence[LoadSignals], limits: SaturationSettings, now: float) -> bool:
    """Every replica of ``replicas`` (a route's eligible ones) has no room (see :func:`room`);
    asked on every request, so it stops at the first replica with room.

    False for none at all: a route without an eligible replica is not saturated but down
    (the runner answers 503 ``no_healthy_replica``); queueing would only delay that."""
    unseen = is_blind(replicas, limits, now)
    return bool(replicas) and all(full_reason(r, limits, now, unseen) is not None for r in replicas)
