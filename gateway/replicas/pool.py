"""Replicas as the gateway tracks them: health, in-flight counts, scraped engine numbers.

Health has two inputs.  *Active*: ``GET /health`` every ``interval_s``; ``unhealthy_threshold``
consecutive failures take a replica out, ``healthy_threshold`` successes bring it back.
*Passive* (outlier detection on real traffic): ``passive_5xx_threshold`` consecutive failures
(5xx, connect failures, broken connections, stalled streams) or a failure rate above
``failure_rate_percent`` over a window *eject* the replica — never a single failure, since one
connect timeout is what any overloaded replica gives.  The n-th ejection in a row lasts
``eject_s * 2^(n-1)`` (capped at ``max_eject_s``) and ends only with a good active check or a
request that succeeds there (panic traffic): a replica whose ``/health`` is fine but whose
completions fail must not flap straight back.  Back from an ejection it is on probation: one
failure ejects it again, ``passive_5xx_threshold`` successes in a row end the probation.
The rules that need the whole fleet (ejection cap, panic mode, slow replicas) live in
:mod:`gateway.replicas.outlier`.

*Restarts* are noticed two ways, and each is logged, counted (``restarts_detected``) and
passed to the fleet (``Fleet.note_cold``, where warm restarts hook in): the engine's counters
went backwards between two scrapes (``counters_reset``: vLLM restarted, its prefix cache is
empty, whether or not a health check saw it down), or the replica returned to healthy after
being down or ejected (``rejoined``: it may have restarted meanwhile).

When a replica goes down, requests still waiting for its answer are told (``on_down``): the
proxy retries them elsewhere instead of leaving them stuck on a frozen process.

In-flight counts are plain ints: the event loop is single-threaded, and the runner
increments them at decision time, so policies see load that no scrape could show yet.  The
load counters and the health and slow flags are properties that tell the replica's
*watchers* (the route runners whose pools hold it) of every change, so a runner keeps its
fleet's aggregates and eligible set up to date without a pass over the pool per request
(see :mod:`gateway.routing.load`).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from gateway.config import HealthSettings, ReplicaConfig
from gateway.replicas.engine import EngineStats
from gateway.replicas.window import FailureWindow
from gateway.routing.base import ReplicaView
from gateway.upstream.client import UpstreamClient

log = logging.getLogger("prefix_gateway.replicas")

#: the engine's counters compared between scrapes: any one going backwards is a restart
RESET_COUNTERS = ("prefix_cache_queries", "prompt_tokens", "generation_tokens")
#: why a replica is thought to have an empty cache (a metric label: keep it small)
COLD_CAUSES = ("counters_reset", "rejoined")
#: smoothing of the time-to-first-byte average (weight of the newest sample)
TTFB_ALPHA = 0.2
#: tokens of prefill a request costs beyond its own and the work queued ahead of it (the engine
#: step it waits for, scheduling): keeps time per token of work finite for fully cached prompts
TTFB_WORK_FLOOR_TOKENS = 1024


def counters_went_back(before: EngineStats | None, after: EngineStats) -> bool:
    """Whether a monotonic engine counter is lower in ``after`` than in ``before`` (a restart)."""
    if before is None:
        return False
    for field in RESET_COUNTERS:
        old, new = getattr(before, field), getattr(after, field)
        if old is not None and new is not None and new < old:
            return True
    return False


class FleetRules(Protocol):
    """What a replica asks of the fleet it belongs to (``gateway.replicas.outlier.Fleet``)."""

    def may_eject(self, replica: Replica, now: float) -> bool:
        """Whether ejecting ``replica`` now keeps the ejected share within the cap."""

    def note_cold(self, replica: Replica, cause: str) -> None:
        """``replica`` may have come back with an empty prefix cache (``cause``: one of COLD_CAUSES)."""

    def note_ttfb(self, now: float) -> None:
        """A replica has a new time-to-first-byte sample."""


class ReplicaWatcher(Protocol):
    """Keeps aggregates over replicas (a route runner): told of each change as it happens."""

    def load_changed(self, replica: Replica, in_flight: int, pending: int) -> None:
        """``replica``'s in-flight count (peers included) moved by ``in_flight``, its queued
        prefill tokens (peers included) by ``pending``."""

    def state_changed(self, replica: Replica) -> None:
        """``replica``'s health or slow flag changed (who is eligible may have changed)."""

    def capacity_changed(self, replica: Replica) -> None:
        """A scrape told ``replica``'s KV cache size for the first time, or a new one."""


class _Watched:
    """A replica attribute whose changes the replica's watchers hear of (stored as ``_name``)."""

    __slots__ = ("attr",)

    def __init__(self) -> None:
        self.attr = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, replica: Replica | None, owner: type | None = None) -> Any:
        if replica is None:  # looked up on the class (introspection, mocks): the descriptor
            return self
        return getattr(replica, self.attr)


class _LoadCounter(_Watched):
    """A load counter (in flight, or queued prefill tokens): watchers hear of each delta."""

    __slots__ = ("pending",)

    def __init__(self, pending: bool) -> None:
        super().__init__()
        self.pending = pending

    def __set__(self, replica: Replica, value: int) -> None:
        delta = value - getattr(replica, self.attr)
        setattr(replica, self.attr, value)
        if delta and replica._watchers:
            replica._load_moved(0, delta) if self.pending else replica._load_moved(delta, 0)


class _StateFlag(_Watched):
    """A flag that decides whether the replica is eligible (healthy, slow): watchers hear of changes."""

    __slots__ = ()

    def __set__(self, replica: Replica, value: bool) -> None:
        if value != getattr(replica, self.attr):
            setattr(replica, self.attr, value)
            replica._state_moved()


class PrefillCharge(int):
    """Prompt tokens charged to one replica's queued prefill, with their place in its line.

    An ``int`` (the tokens: every caller adds, compares and hands it back as before) that also
    knows which of the replica's open charges it is, so the replica can tell the oldest one —
    the prefill its first-come engine is computing now — from the work queued behind it.
    """

    ticket: int
    flow: str | None  # the named flow charged (RequestView.flow), None: anonymous


class Replica:
    """One upstream server and everything the gateway knows about it right now."""

    #: bumped whenever any replica's scraped block size changes: routes following their engines'
    #: block size (``prefix.block_size: auto``) re-read them only then, not on every request
    block_size_epoch: ClassVar[int] = 0

    # Watched (see ReplicaWatcher): requests in flight here from this gateway process and as
    # other processes report them (state.backend: redis); uncached prompt tokens sent here
    # with no first byte yet (see ReplicaView.pending_prefill_tokens), ours and the peers'.
    in_flight = _LoadCounter(pending=False)
    peer_in_flight = _LoadCounter(pending=False)
    pending_prefill_tokens = _LoadCounter(pending=True)
    peer_pending_prefill_tokens = _LoadCounter(pending=True)
    healthy = _StateFlag()
    slow = _StateFlag()  # deprioritized for a high time to first byte (see gateway.replicas.outlier)

    def __init__(
        self,
        config: ReplicaConfig,
        client: UpstreamClient,
        health: HealthSettings,
        api_key: str | None = None,
        fleet: FleetRules | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self.url = config.url
        self.weight = config.weight
        self.client = client
        self.auth_header = f"Bearer {api_key}" if api_key else None
        self._health = health
        # weak: a route runner replaced by a config reload stops watching once it is gone
        self._watchers: list[weakref.ref[ReplicaWatcher]] = []
        self._healthy = True
        self._in_flight = 0
        self._pending_prefill_tokens = 0  # see ReplicaView.pending_prefill_tokens
        # what other gateway processes report for this replica (state.backend: redis)
        self._peer_in_flight = 0
        self._peer_pending_prefill_tokens = 0
        self.active_failures = 0
        self.active_successes = 0
        self.passive_5xx = 0
        self.ejected_until = 0.0
        self.last_error: str | None = None
        self.last_probe: float | None = None
        # this process's open prefill charges, oldest first (ticket -> tokens; see PrefillCharge)
        self._charges: dict[int, int] = {}
        self._tickets = 0
        # of this process's queued prefill here, each named flow's (see ReplicaView.pending_prefill_by_flow)
        self.pending_prefill_by_flow: dict[str, int] = {}
        self.engine: EngineStats | None = None
        # first bytes this process saw from the replica (or attempts that ended before one), in
        # all and as of the last scrape: how far the scraped waiting queue has moved since
        self.answers = 0
        self._answers_at_scrape = 0
        self.block_size: int | None = None  # the engine's block size as last published (vllm:cache_config_info)
        # (prefix_cache_hits, prefix_cache_queries) at the first scrape that had them: the
        # engine's counters run since *it* started, windows of this gateway start here.
        self.engine_baseline: tuple[float, float] | None = None
        self.engine_error: str | None = None
        self.health_changes = 0
        # -- outlier detection (see the module docstring and gateway.replicas.outlier) --
        self.fleet: FleetRules | None = fleet
        self.window = FailureWindow(health.failure_rate_window_s)
        self.ejections = 0  # ejections in a row: the back-off exponent
        self.ejections_total = 0
        self.eject_denied = 0  # ejections the fleet's cap refused
        self.failures_total = 0  # failed requests seen by passive checking
        self.passive_recoveries = 0
        self.cancelled_on_down = 0  # waiting requests moved away when it went down
        self.probation = False
        self._probation_successes = 0
        self.returned_at = 0.0
        self.ttfb_ewma: float | None = None  # smoothed time to first byte of streams (s)
        self.ttfb_samples = 0
        # ... per token of prefill work queued ahead of the request plus its own (see outlier.refresh_slow)
        self.ttfb_per_work_ewma: float | None = None
        self.ttfb_work_samples = 0
        self._slow = False
        self._slow_skips = 0
        self.restarts_detected = dict.fromkeys(COLD_CAUSES, 0)
        self.reset_after: float | None = None  # the last scrape before a counters reset (monotonic)
        self._down_listeners: dict[int, Callable[[], None]] = {}
        self._listener_seq = 0

    # -- watched counters and flags (see ReplicaWatcher) ------------------------------------
    def watch(self, watcher: ReplicaWatcher) -> None:
        """Tell ``watcher`` of every load, health and slow change from now on (held weakly)."""
        live = [ref for ref in self._watchers if ref() is not None and ref() is not watcher]
        self._watchers = [*live, weakref.ref(watcher)]

    def unwatch(self, watcher: ReplicaWatcher) -> None:
        self._watchers = [ref for ref in self._watchers if ref() is not None and ref() is not watcher]

    def _live_watchers(self) -> list[ReplicaWatcher]:
        return [watcher for ref in self._watchers if (watcher := ref()) is not None]

    def _load_moved(self, in_flight: int, pending: int) -> None:
        for ref in self._watchers:  # per request: no list built
            watcher = ref()
            if watcher is not None:
                watcher.load_changed(self, in_flight, pending)

    def _state_moved(self) -> None:
        for watcher in self._live_watchers():
            watcher.state_changed(self)

    # -- views -------------------------------------------------------------------------
    def view(self) -> ReplicaView:
        engine = self.engine
        return ReplicaView(
            self.name,
            self.weight,
            self.in_flight + self.peer_in_flight,
            None if engine is None else engine.kv_cache_usage,
            None if engine is None else engine.waiting,
            self.pending_prefill_tokens + self.peer_pending_prefill_tokens,
            None if engine is None else engine.kv_cache_tokens,
            self.block_size,
            dict(self.pending_prefill_by_flow),
        )

    def set_engine(self, engine: EngineStats) -> None:
        """A fresh scrape of the engine's metrics."""
        reset = counters_went_back(self.engine, engine)
        if reset and self.engine is not None:
            self.reset_after = self.engine.scraped_at  # the restart happened after this scrape
        before = None if self.engine is None else self.engine.kv_cache_tokens
        if engine.block_size is not None and engine.block_size != self.block_size:
            # sticky: a scrape without vllm:cache_config_info (an engine restarting) keeps the last size
            self.block_size = engine.block_size
            Replica.block_size_epoch += 1  # routes re-read their replicas' block sizes (gateway.routing.routes)
        self.engine = engine
        self._answers_at_scrape = self.answers
        capacity = engine.kv_cache_tokens
        if capacity is not None and capacity != before:
            for watcher in self._live_watchers():
                watcher.capacity_changed(self)
        self.engine_error = None
        if reset:
            self.engine_baseline = None  # windows of the new engine start at this scrape
            self._cold("counters_reset", "its engine counters went backwards (restarted: empty prefix cache)")
        if (
            self.engine_baseline is None
            and engine.prefix_cache_hits is not None
            and engine.prefix_cache_queries is not None
        ):
            self.engine_baseline = (engine.prefix_cache_hits, engine.prefix_cache_queries)

    def charge_prefill(self, tokens: int, flow: str | None = None) -> PrefillCharge:
        """Queue ``tokens`` of prefill work here (``pending_prefill_tokens``, and the named
        ``flow``'s share) until :meth:`discharge_prefill` hands the returned charge back."""
        charge = PrefillCharge(tokens)
        self._tickets += 1
        charge.ticket = self._tickets
        charge.flow = flow
        if tokens > 0:
            self._charges[charge.ticket] = tokens
            if flow is not None:
                by_flow = self.pending_prefill_by_flow
                by_flow[flow] = by_flow.get(flow, 0) + tokens
            self.pending_prefill_tokens += tokens
        return charge

    def discharge_prefill(self, charged: int) -> None:
        """The prefill of ``charged`` is no longer queued here (a plain int: just subtracted)."""
        ticket = getattr(charged, "ticket", None)
        if ticket is not None:
            self._charges.pop(ticket, None)
        flow = getattr(charged, "flow", None)
        if flow is not None and charged > 0:
            by_flow = self.pending_prefill_by_flow
            left = by_flow.get(flow, 0) - charged
            if left > 0:
                by_flow[flow] = left
            else:
                by_flow.pop(flow, None)  # a flow's entry lives only while it has work queued here
        self.pending_prefill_tokens = max(0, self.pending_prefill_tokens - charged)

    @property
    def head_prefill_tokens(self) -> int:
        """The oldest open prefill of this process here: what a first-come engine is computing
        now (0: none).  Flow control counts only the work queued behind it (gateway.flow)."""
        for tokens in self._charges.values():
            return tokens
        return 0

    def answered(self) -> None:
        """One of this process's requests here got its first byte, or ended before one."""
        self.answers += 1

    @property
    def waiting_now(self) -> float | None:
        """The engine's waiting queue now, dead-reckoned from the last scrape.

        The scrape is up to an interval old (5 s by default), and a burst the engine has since
        worked through would still read as a full queue.  Each answer seen since (a first
        byte: one request left the engine's prefill, so one waiting request can be scheduled)
        takes one off.  Only this process's answers count, so with peers (other gateway
        pods, direct clients) the figure errs high — on the side of "no room" — never low.
        """
        engine = self.engine
        if engine is None or engine.waiting is None:
            return None
        return max(0.0, engine.waiting - (self.answers - self._answers_at_scrape))

    @property
    def health_settings(self) -> HealthSettings:
        return self._health

    # -- health transitions ------------------------------------------------------------
    def _down(self, reason: str, *, now: float) -> None:
        self.last_error = reason
        self.active_successes = 0
        if self.healthy:
            self.healthy = False
            self.health_changes += 1
            log.warning("replica %s is now UNHEALTHY: %s", self.name, reason)
            for listener in list(self._down_listeners.values()):
                listener()

    def _up(self, now: float, how: str = "active check") -> None:
        if not self.healthy:
            self.healthy = True
            self.health_changes += 1
            self.passive_5xx = 0
            self.window.clear()
            if self.ejections:
                self.probation = True
                self._probation_successes = 0
            self.returned_at = now
            log.info("replica %s is healthy again (%s)", self.name, how)
            self._cold("rejoined", "it is back after being down (it may have restarted)")

    def _cold(self, cause: str, why: str) -> None:
        """The replica may have an empty prefix cache now: count it and tell the fleet (warm restarts)."""
        self.restarts_detected[cause] += 1
        if cause == "counters_reset":
            log.warning("replica %s: %s", self.name, why)
        if self.fleet is not None:
            self.fleet.note_cold(self, cause)

    def _eject(self, reason: str, now: float) -> None:
        h = self._health
        if self.fleet is not None and not self.fleet.may_eject(self, now):
            self.eject_denied += 1
            return
        if self.returned_at and now - self.returned_at > max(h.max_eject_s, h.eject_s):
            self.ejections = 0  # behaved for a long while since the last one: start over
        self.ejections += 1
        self.ejections_total += 1
        self.probation = False
        length = min(h.max_eject_s, h.eject_s * 2 ** min(self.ejections - 1, 30))
        self.ejected_until = max(self.ejected_until, now + length)
        self._down(f"ejected for {length:g} s: {reason}", now=now)

    # -- passive checks: real traffic ----------------------------------------------------
    def report_ok(self, now: float | None = None) -> None:
        """A real request got a non-5xx answer."""
        now = time.monotonic() if now is None else now
        self.passive_5xx = 0
        self.window.add(False, now)
        if self.probation:
            self._probation_successes += 1
            if self._probation_successes >= self._health.passive_5xx_threshold:
                self.probation = False
        if not self.healthy and now >= self.ejected_until:
            # panic traffic (or a request that outlived a failed check) got through: it is back
            self.passive_recoveries += 1
            self._up(now, "a request succeeded")

    def report_failure(self, reason: str, now: float | None = None) -> None:
        """A real request failed because of this replica (5xx, transport failure, stall)."""
        now = time.monotonic() if now is None else now
        self.passive_5xx += 1
        self.failures_total += 1
        self.window.add(True, now)
        if not self.healthy and self.ejected_until > now:
            return  # already out
        h = self._health
        if self.probation:
            self._eject(f"{reason} while on probation (passive)", now)
        elif self.passive_5xx >= h.passive_5xx_threshold:
            self._eject(f"{self.passive_5xx} consecutive failures, last: {reason} (passive)", now)
        elif (
            h.failure_rate_percent > 0
            and self.window.total >= h.failure_rate_min_requests
            and self.window.rate() * 100.0 >= h.failure_rate_percent
        ):
            self._eject(
                f"{self.window.failed} of {self.window.total} requests failed in "
                f"{h.failure_rate_window_s:g} s, last: {reason} (passive)",
                now,
            )

    def report_5xx(self, status: int, now: float | None = None) -> None:
        self.report_failure(f"HTTP {status}", now)

    def report_transport_error(self, reason: str, now: float | None = None) -> None:
        """A real request could not reach the replica (refused, connect timeout, reset): one failure."""
        self.report_failure(reason, now)

    def record_ttfb(self, seconds: float, work_tokens: int | None = None, now: float | None = None) -> None:
        """Time from sending a stream request to its first byte: the slow-replica signal.

        ``work_tokens``: the prefill the gateway knew queued on the replica when it sent the
        request, plus the request's own uncached prompt (None: unknown, e.g. no prompt
        estimate): slowness is then judged per token of work, not on queueing.
        """
        ewma = self.ttfb_ewma
        self.ttfb_ewma = seconds if ewma is None else ewma + TTFB_ALPHA * (seconds - ewma)
        self.ttfb_samples += 1
        if work_tokens is not None:
            per = seconds / (max(0, work_tokens) + TTFB_WORK_FLOOR_TOKENS)
            old = self.ttfb_per_work_ewma
            self.ttfb_per_work_ewma = per if old is None else old + TTFB_ALPHA * (per - old)
            self.ttfb_work_samples += 1
        if self.fleet is not None:
            self.fleet.note_ttfb(time.monotonic() if now is None else now)

    def set_slow(self, slow: bool) -> None:
        self.slow = slow
        self._slow_skips = 0
        if slow:
            per_work = self.ttfb_per_work_ewma
            log.warning(
                "replica %s is slow (time to first byte %.3f s%s): deprioritized",
                self.name,
                self.ttfb_ewma,
                "" if per_work is None else f", {per_work * 1000:.4f} s per 1k tokens of prefill work",
            )
        else:
            log.info("replica %s is no longer slow", self.name)

    def slow_turn(self, dry_run: bool = False) -> bool:
        """A slow replica was offered a request: True on every ``slow_probe_every``-th offer."""
        turn = self._slow_skips + 1
        if turn >= self._health.slow_probe_every:
            turn = 0
        if not dry_run:
            self._slow_skips = turn
        return turn == 0

    # -- requests waiting on this replica ------------------------------------------------
    def on_down(self, listener: Callable[[], None]) -> int:
        """Call ``listener`` (synchronously) if the replica goes down; returns a handle for :meth:`off_down`."""
        self._listener_seq += 1
        self._down_listeners[self._listener_seq] = listener
        return self._listener_seq

    def off_down(self, handle: int) -> None:
        self._down_listeners.pop(handle, None)

    # -- active checks -------------------------------------------------------------------
    def record_probe(self, ok: bool, detail: str = "", now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.last_probe = now
        if ok:
            self.active_failures = 0
            self.active_successes += 1
            if (
                not self.healthy
                and self.active_successes >= self._health.healthy_threshold
                and now >= self.ejected_until
            ):
                self._up(now)
        else:
            self.active_successes = 0
            self.active_failures += 1
            self.last_error = detail
            if self.active_failures >= self._health.unhealthy_threshold:
                self._down(f"health check failed: {detail}", now=now)

    def outlier_snapshot(self, now: float | None = None) -> dict[str, object]:
        """Outlier-detection state for ``/admin/stats``."""
        now = time.monotonic() if now is None else now
        return {
            "ejected_for_s": round(max(0.0, self.ejected_until - now), 3),
            "ejections_in_a_row": self.ejections,
            "ejections_total": self.ejections_total,
            "eject_denied": self.eject_denied,
            "probation": self.probation,
            "consecutive_failures": self.passive_5xx,
            "failures_total": self.failures_total,
            "window_requests": self.window.total,
            "window_failure_rate": round(self.window.rate(), 4),
            "passive_recoveries": self.passive_recoveries,
            "cancelled_on_down": self.cancelled_on_down,
            "slow": self.slow,
            "ttfb_ewma_s": None if self.ttfb_ewma is None else round(self.ttfb_ewma, 4),
            "ttfb_per_1k_work_tokens_s": None
            if self.ttfb_per_work_ewma is None
            else round(self.ttfb_per_work_ewma * 1000, 5),
        }

    def snapshot(self) -> dict[str, object]:
        """JSON-friendly state for ``/admin/stats``."""
        engine = self.engine
        return {
            "name": self.name,
            "url": self.url,
            "weight": self.weight,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "pending_prefill_tokens": self.pending_prefill_tokens,
            "peer_in_flight": self.peer_in_flight,
            "peer_pending_prefill_tokens": self.peer_pending_prefill_tokens,
            "last_error": self.last_error,
            "outlier": self.outlier_snapshot(),
            "engine": None
            if engine is None
            else {
                "age_s": round(time.monotonic() - engine.scraped_at, 3),
                "kv_cache_usage": engine.kv_cache_usage,
                "running": engine.running,
                "waiting": engine.waiting,
                "prefix_cache_queries": engine.prefix_cache_queries,
                "prefix_cache_hits": engine.prefix_cache_hits,
                "hit_rate": engine.hit_rate,
                "block_size": engine.block_size,
                "num_gpu_blocks": engine.num_gpu_blocks,
            },
            "engine_error": self.engine_error,
        }
