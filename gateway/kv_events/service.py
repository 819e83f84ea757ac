"""The gateway's KV-event subsystem: one index and one subscription per replica, for every route.

Each gateway process subscribes to every replica itself (no Redis: events are cheap to
receive, and a shared index would lag behind the engine by a round trip).  Membership
follows the gateway's replicas: a reconcile loop starts a subscription for each new replica
(static or discovered) and stops those of replicas that left.  Routes get the precise
matcher attached (:meth:`KvEvents.attach`) when built and after every config reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gateway.kv_events.index import PreciseIndex
from gateway.kv_events.ingest import Ingestor
from gateway.kv_events.routing import PreciseRouting
from gateway.kv_events.settings import KvEndpoint, KvEventsSettings
from gateway.kv_events.sources import Source, base_model, configured_sources, discover
from gateway.replicas.pool import Replica
from gateway.tasks import cancel_and_wait

log = logging.getLogger("prefix_gateway.kv_events")

RECONCILE_S = 1.0  # how often subscriptions are matched to the gateway's replicas
_MODEL_TIMEOUT_S = 2.0


class KvEvents:
    """Owns the precise index, the feeds, the subscriptions and the matcher routes use."""

    def __init__(
        self,
        settings: KvEventsSettings,
        replicas: Callable[[], Mapping[str, Replica]],
        max_depth_tokens: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.replicas = replicas
        self.enabled = settings.enabled is not False
        self.index = PreciseIndex(settings.max_bytes, settings.max_depth_tokens or max_depth_tokens)
        self.ingestor = Ingestor(self.index, clock)
        self.routing = PreciseRouting(
            self.ingestor, settings.stale_s, settings.speculative_s, clock, self.enabled, settings.project_evictions
        )
        self.clock = clock
        self._ctx: Any = None
        self._subs: dict[str, asyncio.Task[None]] = {}
        self._collector: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._restarts_seen: dict[str, int] = {}  # per replica: engine restarts its scrapes showed
        self._routes: list[Any] = []  # the routes attached (follow_routes)

    # -- routes ------------------------------------------------------------------------------
    def attach(self, routes: Iterable[Any], max_depth_tokens: int | None = None) -> None:
        """Give each prefix route the precise matcher (none when disabled); the index keys
        blocks as deep as the deepest route window (unless ``max_depth_tokens`` is set)."""
        if max_depth_tokens and not self.settings.max_depth_tokens:
            self.index.max_depth_tokens = max_depth_tokens
        self._routes = list(routes)
        for route in self._routes:
            route.attach_precise(self.routing if self.enabled else None)
        # the new routes' block sizes first, then the old routes' go: a route renamed by a reload
        # (same replicas, same size) re-keys nothing
        self.follow_routes()
        self.index.keep_routes({route.name for route in self._routes})

    def follow_routes(self) -> None:
        """Let each route re-choose its block size from its replicas' last scrape now, not on
        its next request: the index keys their events at that size from the first one
        (``PreciseIndex.key_at``; a later change of key size drops what was learned)."""
        for route in self._routes:
            route.follow_engines()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if not self.enabled:
            return
        import zmq.asyncio  # only when used: a gateway with events off never loads libzmq

        from gateway.kv_events.subscriber import Collector

        self._ctx = zmq.asyncio.Context()
        if self.settings.collector_bind:
            self._collector = Collector(self._ctx, self.ingestor, self.settings, lambda n: n in self.replicas())
            self._tasks.append(asyncio.create_task(self._guard(self._collector.run, "collector"), name="kv-collector"))
        self.reconcile()
        self._tasks.append(asyncio.create_task(self._reconcile_loop(), name="kv-reconcile"))

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks, *self._subs.values())
        self._tasks.clear()
        self._subs.clear()
        if self._ctx is not None:
            self._ctx.destroy(0)
            self._ctx = None

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_S)
            try:
                self.reconcile()
            except Exception:  # never stop following membership over one bad pass
                log.exception("kv events: reconcile failed")

    def reconcile(self) -> None:
        """Subscribe to replicas that joined, unsubscribe (and forget) those that left."""
        self.follow_routes()
        current = self.replicas()
        for name in [n for n in self._subs if n not in current]:
            self._subs.pop(name).cancel()
            self.ingestor.forget(name)
            self._restarts_seen.pop(name, None)
        self.notice_restarts(current)
        for name, replica in current.items():
            task = self._subs.get(name)
            if task is not None and not task.done():
                continue
            self._subs[name] = asyncio.create_task(self._subscribe(replica), name=f"kv-sub-{name}")

    def notice_restarts(self, current: Mapping[str, Replica]) -> None:
        """A replica whose engine counters went backwards restarted with an empty cache: clear
        its entries now.  Its sequence going back to 0 says the same, but only once it
        publishes again, and an idle restarted engine publishes nothing."""
        for name, replica in current.items():
            restarts = getattr(replica, "restarts_detected", {}).get("counters_reset", 0)
            seen = self._restarts_seen.setdefault(name, restarts)
            if restarts > seen:
                self._restarts_seen[name] = restarts
                feed = self.ingestor.feeds.get(name)
                after = getattr(replica, "reset_after", None)
                if feed is not None and feed.fresh_since is not None and after is not None and feed.fresh_since > after:
                    # the feed saw this restart itself (its publisher went away, or its sequence
                    # went back) and cleared then: what it holds now is the new engine's
                    continue
                if feed is not None:
                    feed.restarts += 1
                self.ingestor.new_stream(name)

    async def _subscribe(self, replica: Replica) -> None:
        from gateway.kv_events.subscriber import Subscription

        configured = self.settings.endpoints.get(replica.name)
        source = "config" if configured is not None else "discovery"

        async def resolve() -> tuple[list[Source], str | None]:
            model = await base_model(replica, _MODEL_TIMEOUT_S)
            if model is None:
                return [], "/v1/models: no base model (unreachable?)"
            self.index.set_model(replica.name, model)
            if configured is not None:
                return configured_sources(configured, replica.url), None
            found, why = [], "not listed in kv_events.endpoints (discover: false)"
            if self.settings.discover:
                found, why = await discover(replica, _MODEL_TIMEOUT_S)
            fallback = self.settings.fallback_endpoint
            if not found and fallback is not None:
                endpoint = KvEndpoint(endpoint=fallback, replay_endpoint=self.settings.fallback_replay_endpoint)
                return configured_sources([endpoint], replica.url), None
            return found, why

        sub = Subscription(replica.name, self._ctx, self.ingestor, self.settings, resolve, source)
        await self._guard(sub.run, f"subscription {replica.name}")

    async def _guard(self, run: Callable[[], Any], what: str) -> None:
        """Run ``run`` until cancelled; a bug restarts it after a pause instead of ending it."""
        while True:
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kv events: %s failed; restarting", what)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(self.settings.rediscover_s)

    # -- views -------------------------------------------------------------------------------
    def mode_of(self, name: str, block_size: int | None = None) -> tuple[str, str | None]:
        return self.routing.mode_of(name, block_size)

    def snapshot(self) -> dict[str, Any]:
        """``/admin/stats``'s ``kv_events`` section."""
        now = self.clock()
        replicas: dict[str, Any] = {}
        for name in self.replicas():
            feed = self.ingestor.feeds.get(name)
            row: dict[str, Any] = (
                feed.as_dict(now, self.settings.stale_s) if feed is not None else {"mode": "approximate"}
            )
            row["mode"], row["reason"] = self.mode_of(name)
            row["indexed_blocks"] = self.index.blocks(name)
            row["block_size"] = self.index.block_size(name)
            row["keyed_at"] = self.index.keyed_size(name)  # tokens per key: the route's where it divides block_size
            replicas[name] = row
        return {
            "enabled": self.settings.enabled,
            "index": {
                "blocks": self.index.blocks(),
                "memory_bytes": self.index.memory_bytes(),
                "max_bytes": self.index.max_bytes,
                "max_depth_tokens": self.index.max_depth_tokens,
                "evicted": self.index.evicted,
                "skipped": {k: v for k, v in self.index.skipped.items() if v},
            },
            "speculative_entries": len(self.routing.speculative),
            # past the window: (replica, text key) entries, and those keeping the next chunk's prints
            "text_tail": {"keys": len(self.routing.text_tail), "prints": self.routing.text_tail.prints},
            "collector": None
            if self._collector is None
            else {"bound": self._collector.bound, "unknown_topic": self._collector.unknown_topic},
            "replicas": replicas,
        }
