"""Replicas as the gateway tracks them: health, in-flight counts, scraped engine numbers.

Health has two inputs.  *Active*: ``GET /health`` every ``interval_s``; ``unhealthy_threshold``
consecutive failures take a replica out, ``healthy_threshold`` successes bring it back.
*Passive*: real traffic — a connection failure takes it out at once, ``passive_5xx_threshold``
consecutive 5xx answers too; either way it stays out at least ``eject_s`` and then needs a
good active check (a replica whose ``/health`` is fine but whose completions fail must not
flap straight back).

In-flight counts are plain ints: the event loop is single-threaded, and the runner
increments them at decision time, so policies see load that no scrape could show yet.
"""

from __future__ import annotations

import logging
import time

from gateway.config import HealthSettings, ReplicaConfig
from gateway.replicas.engine import EngineStats
from gateway.routing.base import ReplicaView
from gateway.upstream.client import UpstreamClient

log = logging.getLogger("prefix_gateway.replicas")


class Replica:
    """One upstream server and everything the gateway knows about it right now."""

    def __init__(
        self,
        config: ReplicaConfig,
        client: UpstreamClient,
        health: HealthSettings,
        api_key: str | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self.url = config.url
        self.weight = config.weight
        self.client = client
        self.auth_header = f"Bearer {api_key}" if api_key else None
        self._health = health
        self.healthy = True
        self.in_flight = 0
        self.pending_prefill_tokens = 0  # see ReplicaView.pending_prefill_tokens
        # what other gateway processes report for this replica (state.backend: redis)
        self.peer_in_flight = 0
        self.peer_pending_prefill_tokens = 0
        self.active_failures = 0
        self.active_successes = 0
        self.passive_5xx = 0
        self.ejected_until = 0.0
        self.last_error: str | None = None
        self.last_probe: float | None = None
        self.engine: EngineStats | None = None
        # (prefix_cache_hits, prefix_cache_queries) at the first scrape that had them: the
        # engine's counters run since *it* started, windows of this gateway start here.
        self.engine_baseline: tuple[float, float] | None = None
        self.engine_error: str | None = None
        self.health_changes = 0

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
        )

    def set_engine(self, engine: EngineStats) -> None:
        """A fresh scrape of the engine's metrics."""
        self.engine = engine
        self.engine_error = None
        if (
            self.engine_baseline is None
            and engine.prefix_cache_hits is not None
            and engine.prefix_cache_queries is not None
        ):
            self.engine_baseline = (engine.prefix_cache_hits, engine.prefix_cache_queries)

    # -- health transitions ------------------------------------------------------------
    def _down(self, reason: str, *, eject: bool, now: float) -> None:
        self.last_error = reason
        self.active_successes = 0
        if eject:
            self.ejected_until = max(self.ejected_until, now + self._health.eject_s)
        if self.healthy:
            self.healthy = False
            self.health_changes += 1
            log.warning("replica %s is now UNHEALTHY: %s", self.name, reason)

    def _up(self) -> None:
        if not self.healthy:
            self.healthy = True
            self.health_changes += 1
            self.passive_5xx = 0
            log.info("replica %s is healthy again", self.name)

    def report_ok(self) -> None:
        """A real request got a non-5xx answer."""
        self.passive_5xx = 0

    def report_5xx(self, status: int, now: float | None = None) -> None:
        self.passive_5xx += 1
        if self.passive_5xx >= self._health.passive_5xx_threshold:
            self._down(
                f"{self.passive_5xx} consecutive {status} answers (passive)",
                eject=True,
                now=time.monotonic() if now is None else now,
            )

    def report_transport_error(self, reason: str, now: float | None = None) -> None:
        """A real request could not reach the replica (connection refused/reset)."""
        self._down(f"{reason} (passive)", eject=True, now=time.monotonic() if now is None else now)

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
                self._up()
        else:
            self.active_successes = 0
            self.active_failures += 1
            self.last_error = detail
            if self.active_failures >= self._health.unhealthy_threshold:
                self._down(f"health check failed: {detail}", eject=False, now=now)

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
