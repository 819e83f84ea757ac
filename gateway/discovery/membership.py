"""Pool membership at run time: the one place replicas join and leave.

Two inputs change who is in a pool: a config reload (the static ``replicas:`` list) and
discovery sources (DNS, EndpointSlices).  Both come here, and each change is applied the
same way, under one lock:

- a replica that joins gets its client started and one health probe, then enters the pools
  of the routes that list it (or its source): ``PolicyRunner.set_replicas`` keeps the runner
  and the policy's ring in step, so only ~1/N of the keys move;
- a replica that leaves (or whose URL changed) leaves every pool at once — no new requests —
  but keeps its client until its in-flight requests and streams finish (or its source's
  ``drain_timeout_s`` passes): *drain*.  Requests already running hold the ``Replica`` object
  and release it as usual;
- every change is logged, counted (``prefix_gateway_discovery_*``, ``..._replicas_draining``)
  and shown in ``/admin/stats``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gateway.config import GatewayConfig, ReplicaConfig, RouteConfig
from gateway.discovery.build import build_sources
from gateway.discovery.settings import DiscoveryConfig
from gateway.discovery.source import Endpoint
from gateway.discovery.stats import SourceStats
from gateway.observe.metrics import GatewayMetrics
from gateway.replicas.monitor import ReplicaMonitor
from gateway.replicas.outlier import Fleet
from gateway.replicas.pool import Replica
from gateway.routing.routes import RouteTable
from gateway.tasks import cancel_and_wait
from gateway.upstream.client import ClientFactory

log = logging.getLogger("prefix_gateway.membership")

STATIC = ""  # the owner key of replicas from the config file


class Host(Protocol):
    """What membership reads and changes of the gateway it serves (``gateway.service.Gateway``).

    Read on each use, never kept: a reload replaces ``config`` and ``routes``.
    """

    config: GatewayConfig
    replicas: dict[str, Replica]
    routes: RouteTable
    metrics: GatewayMetrics
    monitor: ReplicaMonitor
    fleet: Fleet


class Membership:
    """Owns ``gateway.replicas``'s contents after start: adds, drains and re-pools replicas."""

    def __init__(self, gateway: Host, client_factory: ClientFactory, environ: Mapping[str, str]) -> None:
        self.gw = gateway
        self.client_factory = client_factory
        self.environ = environ
        # owner ("" for static, else the source's name) -> replica name -> replica
        self.owned: dict[str, dict[str, Replica]] = {STATIC: dict(gateway.replicas)}
        self.sources: dict[str, SourceStats] = {}
        for source in gateway.config.discovery:
            self.owned[source.name] = {}
            self.sources[source.name] = SourceStats(source.kind)
        self.draining: list[Replica] = []
        self.drained = 0
        self._drain_tasks: set[asyncio.Task[None]] = set()
        self._source_tasks: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()
        self._source_configs: list[dict[str, Any]] = []

    # -- pools -------------------------------------------------------------------------
    def pool(self, route: RouteConfig, config: GatewayConfig | None = None) -> list[Replica]:
        """``route``'s pool now: its static replicas (config order), then each source's (by name).

        ``config``: the one the route comes from, when it is not yet the running one (a reload
        builds its routes before swapping them in)."""
        config = self.gw.config if config is None else config
        static = self.owned[STATIC]
        pool = [static[r.name] for r in config.pool_of(route) if r.name in static]
        for source in config.sources_of(route):
            found = self.owned.get(source, {})
            pool += [found[name] for name in sorted(found)]
        return pool

    def refresh_pools(self) -> None:
        """Give every route the pool it should have now (no-op for routes whose pool is unchanged)."""
        metrics = self.gw.metrics
        for route in self.gw.routes.routes:
            pool = self.pool(route.config)
            old = route.runner.replicas
            if [id(r) for r in pool] == [id(r) for r in old]:
                continue
            route.runner.set_replicas(pool)
            for gone in {r.name for r in old} - {r.name for r in pool}:
                with contextlib.suppress(KeyError):
                    metrics.route_replica_info.remove(route.name, gone)
            metrics.declare_route(route.name, route.policy, [r.name for r in pool])

    # -- changes -----------------------------------------------------------------------
    async def set_static(self, replicas: Sequence[ReplicaConfig], drain_timeout_s: float) -> tuple[int, int]:
        """A reloaded config's ``replicas:``; returns (added, removed).  Pools are *not* refreshed
        here: the reload installs its new routes first, then calls :meth:`refresh_pools`."""
        async with self._lock:
            return await self._reconcile(STATIC, {r.name: r for r in replicas}, drain_timeout_s, refresh=False)

    async def report(self, source: str, endpoints: Sequence[Endpoint]) -> None:
        """A discovery source's current answer (the whole set, not a delta)."""
        settings = next((d for d in self.gw.config.discovery if d.name == source), None)
        if settings is None:  # the source was removed by a reload while it was answering
            return
        wanted: dict[str, ReplicaConfig] = {}
        for ep in endpoints:
            try:
                wanted[ep.name] = ReplicaConfig(
                    name=ep.name, url=ep.url, weight=settings.weight, api_key_env=settings.api_key_env
                )
            except ValueError as exc:
                log.warning("discovery %s: ignoring endpoint %s (%s)", source, ep.url, exc)
        async with self._lock:
            added, removed = await self._reconcile(source, wanted, settings.drain_timeout_s, refresh=True)
            stats = self.sources[source]
            stats.added += added
            stats.removed += removed
            stats.members = sorted(self.owned[source])
            stats.replicas = len(stats.members)

    async def _reconcile(
        self, owner: str, wanted: Mapping[str, ReplicaConfig], drain_timeout_s: float, *, refresh: bool
    ) -> tuple[int, int]:
        current = self.owned.setdefault(owner, {})
        leaving = [r for name, r in current.items() if name not in wanted or wanted[name] != r.config]
        joining = [rc for name, rc in wanted.items() if name not in current or current[name].config != rc]
        taken = {n for o, reps in self.owned.items() if o != owner for n in reps}
        clash = [rc.name for rc in joining if rc.name in taken]
        if clash:
            log.error("%s: replica names %s are already taken by another source; ignored", _who(owner), clash)
            joining = [rc for rc in joining if rc.name not in taken]
        if not leaving and not joining:
            return 0, 0
        new = [await self._start_replica(rc) for rc in joining]
        for replica in leaving:
            current.pop(replica.name, None)
            self.gw.replicas.pop(replica.name, None)
            with contextlib.suppress(ValueError):
                self.gw.monitor.replicas.remove(replica)
        for replica in new:
            current[replica.name] = replica
            self.gw.replicas[replica.name] = replica
            self.gw.monitor.replicas.append(replica)
        if refresh:
            self.refresh_pools()
        for replica in leaving:
            self._start_drain(replica, drain_timeout_s)
        log.info(
            "%s: %d replica(s) joined%s, %d left%s; now %d",
            _who(owner),
            len(new),
            f" ({', '.join(r.name for r in new)})" if new else "",
            len(leaving),
            f" ({', '.join(f'{r.name} draining {r.in_flight} in flight' for r in leaving)})" if leaving else "",
            len(current),
        )
        return len(new), len(leaving)

    async def _start_replica(self, rc: ReplicaConfig) -> Replica:
        """Build a joining replica: client started and probed once (down until a probe says up)."""
        config = self.gw.config
        replica = Replica(
            rc,
            self.client_factory(rc, config.upstream),
            config.health,
            rc.resolved_api_key(self.environ),
            fleet=self.gw.fleet,  # its ejections are capped with the others' (gateway.replicas.outlier)
        )
        await replica.client.start()
        replica.healthy = False  # no traffic before its first good health check
        await self.gw.monitor.probe(replica)
        return replica

    # -- draining ----------------------------------------------------------------------
    def _start_drain(self, replica: Replica, timeout_s: float) -> None:
        self.draining.append(replica)
        task = asyncio.create_task(self._drain(replica, timeout_s), name=f"drain-{replica.name}")
        self._drain_tasks.add(task)
        task.add_done_callback(self._drain_tasks.discard)

    async def _drain(self, replica: Replica, timeout_s: float) -> None:
        """Wait for the replica's running requests, then close its connections."""
        deadline = time.monotonic() + timeout_s
        try:
            while replica.in_flight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if replica.in_flight > 0:
                log.warning("replica %s: drain timeout, closing with %d in flight", replica.name, replica.in_flight)
            else:
                log.info("replica %s drained", replica.name)
        finally:
            with contextlib.suppress(ValueError):
                self.draining.remove(replica)
            self.drained += 1
            await replica.client.close()

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self, sources: Mapping[str, Any]) -> None:
        """Run each discovery source (``name -> object with async run(publish)``) in the background."""
        self._source_configs = [c.model_dump() for c in self.gw.config.discovery]
        for name, source in sources.items():

            async def publish(endpoints: Sequence[Endpoint], name: str = name) -> None:
                await self.report(name, endpoints)

            self._source_tasks.append(asyncio.create_task(self._run_source(name, source, publish), name=name))

    async def _run_source(self, name: str, source: Any, publish: Any) -> None:
        while True:
            try:
                await source.run(publish)
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # a source bug must never stop discovery for good
                self.sources[name].errors += 1
                log.exception("discovery %s failed; restarting it in 5 s", name)
                await asyncio.sleep(5.0)

    async def set_sources(self, configs: Sequence[DiscoveryConfig]) -> None:
        """A reload's ``discovery:``: restart the sources if any changed; a removed one's replicas drain."""
        if [c.model_dump() for c in configs] == self._source_configs:
            return
        await self.stop_sources()
        names = {c.name for c in configs}
        async with self._lock:
            for owner in [o for o in self.owned if o != STATIC and o not in names]:
                await self._reconcile(owner, {}, 600.0, refresh=True)
                del self.owned[owner]
                self.sources.pop(owner, None)
        for config in configs:
            self.owned.setdefault(config.name, {})
            stats = self.sources.get(config.name)
            if stats is None or stats.kind != config.kind:
                self.sources[config.name] = SourceStats(config.kind)
        await self.start(build_sources(configs, self.sources, self.environ))

    async def stop_sources(self) -> None:
        await cancel_and_wait(*self._source_tasks)
        self._source_tasks.clear()

    async def stop(self) -> None:
        """Stop discovery, and close draining replicas' clients (the server is done serving)."""
        await self.stop_sources()
        await cancel_and_wait(*self._drain_tasks)

    def snapshot(self) -> dict[str, Any]:
        """``/admin/stats``: per source and the replicas still draining."""
        return {
            "sources": {name: stats.as_dict() for name, stats in self.sources.items()},
            "draining": [{"name": r.name, "url": r.url, "in_flight": r.in_flight} for r in self.draining],
            "drained": self.drained,
        }


def _who(owner: str) -> str:
    return "config" if owner == STATIC else f"discovery {owner}"
