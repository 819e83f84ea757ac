"""The assembled gateway: phase two of configuration, and the one planning code path.

:class:`Gateway` builds every component from a validated ``GatewayConfig`` (replicas and
their upstream clients, routes with their policies and prefix pipelines, metrics, stats,
auth) and owns their lifecycle; :meth:`Gateway.apply` is the one place a later config (a
reload) becomes the running state.  :meth:`Gateway.plan` turns a parsed body into a routing
decision — the request handler and ``/admin/explain`` both call it, so what explain shows
is what the handler does.  Nothing here knows about ASGI.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

from gateway.auth import KeyChecker
from gateway.config import GatewayConfig
from gateway.config.reload import Reloader
from gateway.discovery.build import build_sources
from gateway.discovery.membership import Membership
from gateway.errors import ModelNotFound
from gateway.flow.classify import named_flow
from gateway.flow.gate import FlowControl
from gateway.http.capacity import BodyReservation, Capacity, Slot
from gateway.kv_events.metrics import KvEventsCollector
from gateway.kv_events.service import KvEvents
from gateway.limits.admission import KeyLimiter, Ticket
from gateway.limits.context import ContextLimits
from gateway.limits.identity import ClientIdentity
from gateway.observe.logs import AccessLog
from gateway.observe.metrics import (
    CapacityCollector,
    GatewayMetrics,
    LimitsCollector,
    MembershipCollector,
    NormalizationCollector,
    ReplicaCollector,
    RouteCollector,
    SyncCollector,
    WarmupCollector,
)
from gateway.observe.outcome import Outcome
from gateway.observe.samples import SampleBuffer
from gateway.observe.stats import StatsBook, normalization_section
from gateway.observe.summary import SummaryReporter
from gateway.prefix.identity import ModelIdentities
from gateway.replicas.monitor import ReplicaMonitor
from gateway.replicas.outlier import Fleet
from gateway.replicas.pool import Replica
from gateway.replicas.warmup import Warmer
from gateway.routing.plan import Draft, Plan, decide
from gateway.routing.routes import Route, RouteTable, build_route, carry_route, request_view
from gateway.routing.shared import prefix_demands, prefix_indexes, prefix_key_caps, prefix_learners
from gateway.state.affinity_sync import AffinitySync
from gateway.state.catchup import CatchUp
from gateway.state.peer_load import PeerLoad
from gateway.state.signing import Signer
from gateway.tasks import cancel_and_wait
from gateway.upstream.aiohttp_client import aiohttp_factory
from gateway.upstream.client import ClientFactory

log = logging.getLogger("prefix_gateway")

STOP_TIMEOUT_S = 10.0  # how long shutdown waits for background tasks and connections to close
# how long a replica removed from the file keeps its connections for running requests
STATIC_DRAIN_TIMEOUT_S = 600.0
#: config sections bound at start: a reload leaves them as they are until a restart
RESTART_ONLY = ("state", "logging", "health", "scrape", "upstream", "limits", "samples", "kv_events")
#: the ``server:`` settings the request path reads per request, so a reload changes them live
SERVER_LIVE = ("max_body_bytes", "response_headers", "max_concurrency", "max_buffered_body_bytes")

ENDPOINT_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}


class Gateway:
    """Components built from one config; start/stop around serving."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        client_factory: ClientFactory = aiohttp_factory,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.config = config
        self.replicas: dict[str, Replica] = {}
        # ejection cap and slow-replica comparison over whatever the membership is now
        self.fleet = Fleet(
            lambda: self.replicas.values(), config.health, lambda: [r.runner.replicas for r in self.routes.routes]
        )
        for rc in config.replicas:
            client = client_factory(rc, config.upstream)
            self.replicas[rc.name] = Replica(rc, client, config.health, rc.resolved_api_key(env), fleet=self.fleet)
        #: which model names are LoRA adapters of which base (the replicas' /v1/models): keys follow it
        self.identities = ModelIdentities()
        self.routes = RouteTable(
            [
                build_route(rc, [self.replicas[r.name] for r in config.pool_of(rc)], identities=self.identities)
                for rc in config.routes
            ]
            # discovered replicas join these pools once their sources answer (gateway.discovery.membership)
        )
        self.monitor = ReplicaMonitor(list(self.replicas.values()), config.health, config.scrape)
        # precise routing from the engines' KV events: one index and subscription per replica
        self.kv_events = KvEvents(config.kv_events, lambda: self.replicas)
        self.kv_events.attach(self.routes.routes, _deepest_window(config))
        # warm restarts (off unless warm_restart.enabled): hot prefixes in, replays out
        self.warmer = Warmer(lambda: self.config, lambda: self.routes.routes, lambda: self.replicas)
        self.fleet.on_cold = self._on_cold
        self.kv_events.routing.on_lost = self._cache_lost
        self.metrics = GatewayMetrics()
        self.capacity = Capacity()  # process-wide caps on the proxied path (server.max_concurrency, ...)
        self.metrics.registry.register(CapacityCollector(self.capacity, lambda: self.config.server))
        self.metrics.registry.register(ReplicaCollector(lambda: list(self.replicas.values())))
        self.metrics.registry.register(RouteCollector(lambda: [(r.name, r.runner) for r in self.routes.routes]))
        self.metrics.registry.register(NormalizationCollector(self._normalizers))
        for route in self.routes.routes:
            self.metrics.declare_route(route.name, route.policy, [r.name for r in route.runner.replicas])
        self.stats = StatsBook()
        #: recent request shapes for /admin/samples and `prefix-gateway doctor` (None: off, the default)
        self.samples = SampleBuffer(config.samples, lambda: self.routes.routes) if config.samples.enabled else None
        self.summary = SummaryReporter(
            self.stats,
            lambda: [(r.name, r.runner.replicas) for r in self.routes.routes],
            config.logging.summary_interval_s,
        )
        self.access_log = AccessLog(config.logging)
        self.admin_keys = KeyChecker(config.admin.key_hashes(env))
        self.client_keys = KeyChecker(config.auth.key_hashes(env))
        self.freeze_heap = False  # set by ``serve``: gc.freeze() once started
        self.catch_up: CatchUp | None = None  # set with shared load (gateway.state.catchup)
        self.state_sync = self._build_state_sync(env)
        if self.state_sync is not None:
            self.metrics.registry.register(SyncCollector(self.state_sync.stats))
        self.limiter = self._build_limiter(env)
        limits = config.limits
        #: whose bucket a request counts against (limits are restart-only: built once)
        self.limit_identity = ClientIdentity(
            limits.client_identity,
            header=limits.forwarded_header,
            trusted_proxies=limits.trusted_proxies,
            ipv6_prefix_len=limits.ipv6_prefix_len,
        )
        self.metrics.registry.register(LimitsCollector(self.limiter.snapshot))
        self.context = ContextLimits(limits.context_bytes_per_token) if limits.context_check else None
        self._context_task: asyncio.Task[None] | None = None
        self.environ = env
        self.membership = Membership(self, client_factory, env)
        self.reloads: dict[str, int] = {"ok": 0, "rejected": 0, "unchanged": 0}
        self.draining = False  # set on SIGTERM (gateway.http.drain): /ready answers 503
        self.reloader: Reloader | None = None  # set by the server when serving from a file
        self.metrics.registry.register(MembershipCollector(self.membership, lambda: self.reloads))
        self.metrics.registry.register(WarmupCollector(self.warmer))
        self.metrics.registry.register(KvEventsCollector(self.kv_events))
        #: held requests while a route is saturated (gateway.flow); per route name, kept across reloads
        self.flow = FlowControl(config.flow_control, self.metrics.registry)
        self.started_at = time.time()

    def _on_cold(self, replica: Replica, cause: str) -> None:
        """``Fleet.on_cold``: a replica whose engine counters went back restarted with an empty
        cache (the routes' models forget it); warm restarts replay its hot prefixes."""
        if cause == "counters_reset":
            self._cache_lost(replica.name)
        self.warmer.on_cold(replica, cause)

    def _cache_lost(self, name: str) -> None:
        """``name``'s engine lost its prefix cache (a restart its scrape showed; its KV events'
        reset, restart or disconnect): every route's affinity model drops what it believed
        ``name`` holds.  Otherwise a replica routed by the model (no events, or its feed gone
        stale) is credited, and chosen, for prefixes its engine no longer has."""
        dropped = sum(index.clear(name) for index in prefix_indexes(self.routes.routes).values())
        if dropped:
            log.info("replica %s lost its prefix cache: its modelled cache is cleared (%d keys)", name, dropped)

    def _build_limiter(self, env: Mapping[str, str]) -> KeyLimiter:
        """Per-key limits; shared through the state Redis when ``state.backend: redis``."""
        limits, state = self.config.limits, self.config.state
        shared = state.backend == "redis" and (limits.per_key_concurrency or limits.per_key_requests_per_s)
        return KeyLimiter(
            limits.per_key_concurrency,
            limits.per_key_requests_per_s,
            limits.per_key_burst,
            redis_url=state.resolved_redis_url(env) if shared else None,
            prefix=f"{state.channel}:limits:",
            lease_s=limits.concurrency_lease_s,
            redis_timeout_s=limits.redis_timeout_ms / 1000.0,
            backoff_s=limits.redis_backoff_ms / 1000.0,
            backoff_max_s=limits.redis_backoff_max_s,
            max_keys=limits.max_keys,
        )

    def _build_state_sync(self, env: Mapping[str, str]) -> AffinitySync | None:
        """With ``state.backend: redis``, share every prefix route's affinity index with peers."""
        state = self.config.state
        if state.backend != "redis":
            return None
        indexes = prefix_indexes(self.routes.routes)
        peer_load = PeerLoad(self.replicas, state.peer_load_ttl_s) if state.share_load else None
        sync = AffinitySync(
            state.resolved_redis_url(env),  # ConfigError naming the env var if it holds no Redis URL
            state.channel,
            indexes,
            max_pending=state.max_pending,
            batch_interval_s=state.batch_interval_ms / 1000.0,
            peer_load=peer_load,
            load_interval_s=state.load_interval_ms / 1000.0,
            signer=Signer(secret) if (secret := state.resolved_secret(env)) else None,
            demands=prefix_demands(self.routes.routes),
            learners=prefix_learners(self.routes.routes),
        )
        sync.key_caps = prefix_key_caps(self.routes.routes, self.config.server.max_body_bytes)
        if peer_load is not None and state.catch_up_keys:
            self.catch_up = CatchUp(sync, state.catch_up_keys, ready_wait_s=state.catch_up_ready_wait_s)
            peer_load.on_new_peer = self.catch_up.new_peer
        return sync

    # -- reconfiguration ---------------------------------------------------------------
    async def apply(self, new: GatewayConfig) -> list[str]:
        """Swap a validated config in without dropping a request; returns notes on what waits for a restart.

        - requests already running keep the ``Route`` and ``Replica`` objects they hold;
        - a route whose policy, policy settings and prefix settings are unchanged keeps its
          runner (ring, affinity index, round-robin turn); other routes get new ones
          (:func:`~gateway.routing.routes.carry_route`); its prompt pipeline keeps what it
          learned — normalization places and discovered rules while ``normalize`` is
          unchanged, tokenizers and token cache while ``prefix`` is;
        - static replicas are reconciled by ``gateway.discovery.membership`` (joiners probed,
          leavers drained); discovery sources are restarted when their settings changed;
        - the :data:`RESTART_ONLY` sections and ``server:`` (but :data:`SERVER_LIVE`) keep
          their old values, each noted.

        Everything that can fail is built before anything changes: an exception leaves the
        running state as it was.
        """
        effective, notes = live_config(self.config, new)
        routes = [
            carry_route(self.routes.get(rc.name), rc, partial(self.membership.pool, rc, effective), self.identities)
            for rc in effective.routes
        ]
        admin_keys = KeyChecker(effective.admin.key_hashes(self.environ))
        client_keys = KeyChecker(effective.auth.key_hashes(self.environ))

        self.config = effective
        await self.membership.set_static(effective.replicas, STATIC_DRAIN_TIMEOUT_S)
        # no await from here to the pool refresh: leavers' drains start only after it
        old_routes = self.routes.routes
        self.routes = RouteTable(routes)
        self.kv_events.attach(routes, _deepest_window(effective))
        self.membership.refresh_pools()
        self.admin_keys, self.client_keys = admin_keys, client_keys
        self.flow.configure(effective.flow_control)
        _redeclare_routes(self.metrics, old_routes, self.routes.routes)
        if self.state_sync is not None:
            routes = self.routes.routes
            self.state_sync.set_indexes(prefix_indexes(routes), prefix_demands(routes), prefix_learners(routes))
            self.state_sync.key_caps = prefix_key_caps(routes, effective.server.max_body_bytes)
        await self.membership.set_sources(effective.discovery)
        return notes

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self._warm_pipelines)
        if self.freeze_heap:
            # Everything built so far (config, vocabularies, regexes, routes) lives as long as
            # the process: out of the collector's reach, a full collection during a request
            # scans only request garbage (a gen-2 pass over the startup heap took ~1 ms).
            # Only for a process that is the gateway (serve): embedded ones (tests) come and go.
            gc.collect()
            gc.freeze()
        await self.monitor.start()
        await self.membership.start(build_sources(self.config.discovery, self.membership.sources, self.environ))
        await self.kv_events.start()
        self.summary.start()
        if self.reloader is not None:
            await self.reloader.start()
        if self.state_sync is not None:
            await self.state_sync.start()
            if self.catch_up is not None:
                self.catch_up.start(time.monotonic())
        await self.limiter.start()
        # before serving: the first requests are checked (context) and keyed (LoRA adapters) too
        try:
            await self._learn_context()
        except Exception:  # the loop retries; the gateway serves meanwhile
            log.exception("reading max_model_len and LoRA adapters from /v1/models failed")
        self._context_task = asyncio.get_running_loop().create_task(self._context_loop(), name="context")

    def _warm_pipelines(self) -> None:
        """Load the tokenizers the prefix routes will use before serving (see PrefixPipeline.warm):
        the models a route names literally, else the vocabulary an unknown name resolves to."""
        for route in self.routes.routes:
            if route.pipeline is None:
                continue
            literal = [m for m in route.config.match.models if not any(ch in m for ch in "*?[")]
            try:
                route.pipeline.warm(literal or [""])
            except Exception:  # a model whose tokenizer cannot load fails its requests clearly, later
                log.warning("could not preload the tokenizer of route %s", route.name, exc_info=True)

    async def stop(self) -> None:
        """Stop the background work, bounded: a part that hangs (a peer that never answers a
        close) is logged and left behind instead of keeping the process from exiting."""
        try:
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await self._stop_parts()
        except TimeoutError:
            log.error("gateway shutdown: background parts still stopping after %.0f s; exiting anyway", STOP_TIMEOUT_S)

    async def _stop_parts(self) -> None:
        if self._context_task is not None:
            await cancel_and_wait(self._context_task)
            self._context_task = None
        await self.limiter.stop()
        if self.reloader is not None:
            await self.reloader.stop()
        if self.state_sync is not None:
            await self.state_sync.stop()
        await self.summary.stop()
        await self.kv_events.stop()
        await self.membership.stop()
        await self.warmer.stop()
        await self.monitor.stop()

    async def _learn_context(self) -> None:
        """What the replicas' ``/v1/models`` say: each model's max_model_len (the context
        check) and which names are LoRA adapters of which base model (routing keys)."""
        self._learn_listing(await self.monitor.models())

    def _learn_listing(self, listing: list[tuple[Replica, list[dict[str, Any]]]]) -> None:
        if self.context is not None:
            self.context.learn(listing)
        if listing:  # no healthy replica answered: keep what was known
            self.identities.learn(listing)

    async def _context_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.limits.models_refresh_s)
            try:
                await self._learn_context()
            except Exception:  # never stop refreshing over one bad listing
                log.exception("refreshing max_model_len and LoRA adapters from /v1/models failed")

    def check_context(self, plan: Plan | Draft, body: Mapping[str, Any]) -> None:
        """400 ``context_length_exceeded`` when the prompt certainly cannot fit (see ``gateway.limits.context``)."""
        if self.context is None:
            return
        prepared = plan.prepared
        exact = None
        if prepared is not None and prepared.tokens_exact:
            exact = prepared.window_tokens  # the model's own tokenizer: the window's count is a lower bound
        self.context.check(plan.endpoint, body, exact)

    # -- planning ----------------------------------------------------------------------
    def route_for(self, endpoint: str, model: str, headers: Mapping[str, str]) -> Route:
        route = self.routes.match(model, headers, endpoint)
        if route is None:
            if self.routes.serves_model(model, headers):
                raise ModelNotFound(
                    f"The model `{model}` is not served on {ENDPOINT_PATHS.get(endpoint, endpoint)} by this gateway.",
                    param="model",
                )
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        return route

    def plan(
        self,
        endpoint: str,
        body: dict[str, Any],
        headers: Mapping[str, str],
        request_id: str = "",
        *,
        dry_run: bool = False,
        key_hash: str | None = None,
    ) -> Plan:
        """Route, prepare (normalize/tokenize/hash when the policy needs keys) and decide:
        :meth:`prepare` then :meth:`decide` (the proxy calls them apart, with flow control's
        queue in between while the route is saturated).

        ``body`` must have passed ``gateway.proxy.parse.parse_body``; ``headers`` have
        lower-case names.  Raises ``ModelNotFound`` (404) or ``NoHealthyReplica`` (503).
        Calls the policy's ``choose`` — stateful policies (round robin) advance — unless
        ``dry_run`` (``/admin/explain``): then nothing advances or is recorded, and the next
        real request is decided as if this plan had never been made.
        """
        draft = self.prepare(endpoint, body, headers, request_id, dry_run=dry_run, key_hash=key_hash)
        return self.decide(draft, dry_run=dry_run)

    def prepare(
        self,
        endpoint: str,
        body: dict[str, Any],
        headers: Mapping[str, str],
        request_id: str = "",
        *,
        dry_run: bool = False,
        key_hash: str | None = None,
    ) -> Draft:
        """Route and prepare, deciding nothing (see :meth:`plan`); ``key_hash``: the client key
        presented (its sha256 hex), which names the request's flow when no fairness header does."""
        model = body["model"]
        route = self.route_for(endpoint, model, headers)
        prepared = None
        if route.needs_keys(endpoint):
            route.follow_engines()  # block_size: auto — the replicas' own, as last scraped
            prepared = route.pipeline.prepare(endpoint, body, learn=not dry_run)  # type: ignore[union-attr]
        session = headers.get(route.session_header)
        flow = named_flow(self.flow.settings, headers, key_hash)
        limit = self.context.limit_for(model) if self.context is not None else None
        request = request_view(route.name, endpoint, body, prepared, session, request_id, flow, limit)
        return Draft(route, endpoint, prepared, request)

    #: place a prepared request (see :func:`gateway.routing.plan.decide`)
    decide = staticmethod(decide)

    # -- admission -----------------------------------------------------------------------
    def release_admission(self, slot: Slot | None, reservation: BodyReservation | None, ticket: Ticket | None) -> None:
        """Give back what admitting a request took — its place among ``server.max_concurrency``,
        its body bytes, its per-key concurrency slot — once it ended (the proxy and the picker)."""
        if reservation is not None:
            reservation.release()
        if slot is not None:
            slot.release()
        if ticket is not None:
            self.limiter.release(ticket)

    # -- recording ---------------------------------------------------------------------
    def record(self, outcome: Outcome, plan: Plan | None = None, body: Mapping[str, Any] | None = None) -> None:
        """Count a finished request; with samples on, keep its shape too (needs its plan and body)."""
        self.metrics.record(outcome)
        self.stats.record(outcome)
        if self.samples is not None and plan is not None and body is not None:
            self.samples.record(plan, body, outcome)

    # -- read-only views ---------------------------------------------------------------
    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready when every route has at least one healthy replica, not draining (SIGTERM), and,
        sharing state, once caught up with the peers' affinity (``gateway.state.catchup``)."""
        routes = {r.name: r.runner.healthy_count() for r in self.routes.routes}
        detail: dict[str, Any] = {"routes": {k: {"healthy_replicas": v} for k, v in routes.items()}}
        if self.draining:
            return False, {"draining": True, **detail}
        caught_up = True
        if self.catch_up is not None:
            caught_up, detail["catch_up"] = self.catch_up.readiness(time.monotonic())
        return all(routes.values()) and caught_up, detail

    async def models(self) -> list[dict[str, Any]]:
        """Union of the models healthy replicas serve, restricted to what some route accepts."""
        seen: dict[str, dict[str, Any]] = {}
        listing = await self.monitor.models()
        self._learn_listing(listing)
        for replica, entries in listing:
            for entry in entries:
                model_id = entry["id"]
                if model_id in seen:
                    continue
                for route in self.routes.routes:
                    if replica in route.runner.replicas and route.config.match.matches(model_id, {}):
                        seen[model_id] = entry
                        break
        return list(seen.values())

    def stats_snapshot(self) -> dict[str, Any]:
        """``GET /admin/stats``: per route and per replica, cumulative since start."""
        routes: dict[str, Any] = {}
        flows = self.flow.snapshot()
        for route in self.routes.routes:
            route.follow_engines()
            tally = self.stats.by_route.get(route.name)
            hits = queries = 0.0
            for replica in route.runner.replicas:
                engine = replica.engine
                if engine and engine.prefix_cache_hits is not None and engine.prefix_cache_queries:
                    hits += engine.prefix_cache_hits
                    queries += engine.prefix_cache_queries
            per_replica = {}
            for replica in route.runner.replicas:
                pair = self.stats.by_route_replica.get((route.name, replica.name))
                per_replica[replica.name] = {
                    **(pair.as_dict() if pair else {"requests": 0}),
                    "in_flight": replica.in_flight,
                    "healthy": replica.healthy,
                    "slow": replica.slow,
                    "engine_hit_rate": None if replica.engine is None else replica.engine.hit_rate,
                    # precise: matched from its engine's KV events; approximate: the gateway's model
                    "kv_mode": self.kv_events.mode_of(replica.name, _route_block_size(route))[0],
                }
            routes[route.name] = {
                "policy": route.policy,
                "normalize": route.normalize_mode,
                "healthy_replicas": route.runner.healthy_count(),
                "panic": route.runner.in_panic(),
                "panic_decisions": route.runner.panic_decisions,
                "replicas": per_replica,
                **(tally.as_dict() if tally else {"requests": 0}),
                "engine_hit_rate": round(hits / queries, 4) if queries else None,
                "reasons": dict(self.stats.reasons.get(route.name, {})),
                "policy_state": _policy_state(route),
                "normalization": normalization_section(
                    route.normalize_mode, route.pipeline.normalizer if route.pipeline else None
                ),
                # the block size the route hashes with and each replica's own (disagreements named)
                "block_size": route.pipeline.block.as_dict() if route.pipeline is not None else None,
                # keys whose prompt tokens replies measured (past the window; gateway.prefix.anchors)
                "prompt_anchors": len(route.pipeline.anchors) if route.pipeline is not None else None,
                # held requests while saturated (gateway.flow); the doctor names a saturated route from it
                "flow_control": flows.get(route.name),
            }
        return {
            "uptime_s": round(time.time() - self.started_at, 3),
            "routes": routes,
            "replicas": {name: replica.snapshot() for name, replica in self.replicas.items()},
            "state": self._state_snapshot(),
            "limits": {
                **self.limiter.snapshot(),
                "max_model_len": dict(self.context.max_len) if self.context is not None else None,
            },
            "capacity": self.capacity.snapshot(
                self.config.server.max_concurrency, self.config.server.max_buffered_body_bytes
            ),
            "membership": self.membership.snapshot(),
            "reloads": dict(self.reloads),
            "warm_restart": self.warmer.snapshot(),
            "models": self.identities.snapshot(),  # LoRA adapters (and aliases) keyed as their base's engine cache
            "kv_events": self.kv_events.snapshot(),
            "flow_control": {"enabled": self.flow.enabled, "routes": flows},
        }

    def _normalizers(self) -> list[tuple[str, Any]]:
        """(route, normalizer) of the current routes (they are rebuilt on a config reload)."""
        return [(r.name, r.pipeline.normalizer) for r in self.routes.routes if r.pipeline is not None]

    def _state_snapshot(self) -> dict[str, Any]:
        sync = self.state_sync
        if sync is None:
            return {"backend": self.config.state.backend}
        catch_up = (
            {"snapshots_sent": self.catch_up.sent, "records_sent": self.catch_up.records} if self.catch_up else {}
        )
        return {"backend": "redis", "channel": sync.channel, "pod": sync.pod_id, **sync.stats.as_dict(), **catch_up}


def live_config(old: GatewayConfig, new: GatewayConfig) -> tuple[GatewayConfig, list[str]]:
    """What of ``new`` a running gateway takes now (settings bound at start keep ``old``'s
    values), and a note for each part that waits for a restart."""
    notes = []
    keep: dict[str, Any] = {}
    for section in RESTART_ONLY:
        if getattr(new, section) != getattr(old, section):
            notes.append(f"{section} changes at restart")
            keep[section] = getattr(old, section)
    # of server:, only what the request path reads per request changes live
    live = {name: getattr(new.server, name) for name in SERVER_LIVE}
    server = old.server.model_copy(update=live)
    if server != new.server:
        notes.append("server listen address, timeouts and HTTP limits change at restart")
    return new.model_copy(update={"server": server, **keep}), notes


def _redeclare_routes(metrics: GatewayMetrics, old_routes: list[Route], routes: list[Route]) -> None:
    """Route info series after a reload: gone routes (and changed policies) removed, the rest declared."""
    current = {r.name: r for r in routes}
    for route in old_routes:
        now = current.get(route.name)
        if now is None or now.policy != route.policy:
            with contextlib.suppress(KeyError):
                metrics.route_info.remove(route.name, route.policy)
        if now is None:
            for replica in route.runner.replicas:
                with contextlib.suppress(KeyError):
                    metrics.route_replica_info.remove(route.name, replica.name)
    for route in routes:
        metrics.declare_route(route.name, route.policy, [r.name for r in route.runner.replicas])


def _deepest_window(config: GatewayConfig) -> int:
    """The deepest token window of the routes: KV-event blocks deeper than it are never asked for."""
    return max((route.prefix.window_tokens for route in config.routes), default=4096)


def _route_block_size(route: Route) -> int | None:
    return route.pipeline.block_size if route.pipeline is not None else None  # the size in use (auto: the engines')


def _policy_state(route: Route) -> dict[str, Any] | None:
    """The policy's own ``snapshot()`` (prefix: ring members, affinity-index occupancy), if it has one."""
    snapshot = getattr(route.runner.policy, "snapshot", None)
    return snapshot() if callable(snapshot) else None
