"""Live reconfiguration: SIGHUP or a changed config file swaps routes, policies and pools in place.

Kubernetes updates a mounted ConfigMap by swapping a symlink (``..data``) to a new directory,
which inotify on the file itself misses; so the file is *polled*: its resolved path, inode,
size and mtime.  A reload is phase one again (the same field-level ``ConfigError``) and, only
if that passes, an in-place swap that drops nothing:

- requests already running keep the ``Route`` and ``Replica`` objects they hold;
- a route whose policy, policy settings and prefix settings are unchanged keeps its runner
  (ring, affinity index, round-robin turn); other routes get new ones;
- static replicas are reconciled by ``gateway.discovery.membership`` (joiners probed, leavers drained);
- discovery sources are restarted when their settings changed.

Settings bound at start — ``server`` (but ``max_body_bytes`` and ``response_headers``, read
per request), ``state``, ``logging``, ``limits``, ``samples``, ``health``, ``scrape`` and
``upstream`` —
keep their old values until a restart, and the log says so.
An invalid file is rejected with its errors; the old config keeps serving.  Every outcome is
logged and counted (``prefix_gateway_config_reloads_total{outcome}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gateway.auth import KeyChecker
from gateway.config import ConfigError, GatewayConfig, RouteConfig, load_config
from gateway.prefix.learn import VarianceLearner
from gateway.prefix.pipeline import PrefixPipeline
from gateway.routing.affinity import AffinityIndex
from gateway.routing.routes import Route, RouteTable, build_route
from gateway.routing.starts import HeadDemand
from gateway.tasks import cancel_and_wait

if TYPE_CHECKING:
    from gateway.service import Gateway

log = logging.getLogger("prefix_gateway.reload")

T = TypeVar("T")

# how long a replica removed from the file keeps its connections for running requests
STATIC_DRAIN_TIMEOUT_S = 600.0
RESTART_ONLY = ("state", "logging", "health", "scrape", "upstream", "limits", "samples")
SERVER_LIVE = ("max_body_bytes", "response_headers")


class Reloader:
    """Reload ``path`` on SIGHUP and whenever it changes (polled every ``poll_s``)."""

    def __init__(self, gateway: Gateway, path: str | os.PathLike[str], poll_s: float = 1.0) -> None:
        self.gw = gateway
        self.path = Path(path)
        self.poll_s = poll_s
        self.last_error: str | None = None
        self._lock = asyncio.Lock()
        self._signature = file_signature(self.path)
        self._task: asyncio.Task[None] | None = None
        self._sighup = False

    async def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="config-watch")
        if threading.current_thread() is threading.main_thread():
            loop = asyncio.get_running_loop()
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload("SIGHUP")))
                self._sighup = True

    async def stop(self) -> None:
        if self._sighup:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await cancel_and_wait(self._task)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            signature = file_signature(self.path)
            if signature != self._signature and signature is not None:
                self._signature = signature
                await self.reload("file changed")

    async def reload(self, reason: str) -> bool:
        """Load, validate and apply the file; False (old config kept) when it is invalid."""
        async with self._lock:
            self._signature = file_signature(self.path) or self._signature
            try:
                new = load_config(self.path)
            except ConfigError as exc:
                self.last_error = str(exc)
                self.gw.reloads["rejected"] += 1
                log.error("config reload (%s) rejected, the running config stays:\n%s", reason, exc)
                return False
            if new == self.gw.config:
                self.gw.reloads["unchanged"] += 1
                log.info("config reload (%s): %s unchanged", reason, self.path)
                return True
            try:
                notes = await apply_config(self.gw, new)
            except Exception as exc:  # a bug here must not take the gateway down
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.gw.reloads["rejected"] += 1
                log.exception("config reload (%s) failed while applying; the running config stays", reason)
                return False
            self.last_error = None
            self.gw.reloads["ok"] += 1
            log.info(
                "config reload (%s) applied from %s: routes %s%s",
                reason,
                self.path,
                ", ".join(f"{r.name}={r.policy}" for r in self.gw.routes.routes),
                "".join(f"; {note}" for note in notes),
            )
            return True


def file_signature(path: Path) -> tuple[Any, ...] | None:
    """What changes when the file (or the symlink chain leading to it) is replaced."""
    try:
        st = os.stat(path)
        return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        return None


def _same_policy(old: RouteConfig, new: RouteConfig) -> bool:
    return (old.policy, old.policy_settings, old.prefix) == (new.policy, new.policy_settings, new.prefix)


def _next_route(gw: Gateway, rc: RouteConfig) -> Route:
    """The route to serve ``rc`` with: the old one, the old runner with new matching, or new."""
    old = gw.routes.get(rc.name)
    if old is not None and old.config == rc:
        return old
    if old is not None and _same_policy(old.config, rc):
        pipeline = PrefixPipeline(rc.normalize, rc.prefix) if old.pipeline is not None else None
        return dataclasses.replace(
            old,
            config=rc,
            pipeline=pipeline,
            endpoints=frozenset(rc.endpoints),
            session_header=rc.session_header.lower(),
        )
    return build_route(rc, gw.membership.pool(rc))


async def apply_config(gw: Gateway, new: GatewayConfig) -> list[str]:
    """Swap ``new`` in without dropping a request; returns notes on what waits for a restart."""
    old = gw.config
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
    effective = new.model_copy(update={"server": server, **keep})

    # everything that can fail is built before anything changes
    gw.config, previous = effective, gw.config
    try:
        routes = [_next_route(gw, rc) for rc in effective.routes]
    except Exception:
        gw.config = previous
        raise
    admin_keys = KeyChecker(effective.admin.key_hashes(gw.environ))
    client_keys = KeyChecker(effective.auth.key_hashes(gw.environ))

    await gw.membership.set_static(effective.replicas, STATIC_DRAIN_TIMEOUT_S)
    # no await from here to the pool refresh: leavers' drains start only after it
    old_routes = gw.routes.routes
    gw.routes = RouteTable(routes)
    gw.membership.refresh_pools()
    gw.admin_keys, gw.client_keys = admin_keys, client_keys
    _update_route_metrics(gw, old_routes)
    if gw.state_sync is not None:
        routes = gw.routes.routes
        gw.state_sync.set_indexes(prefix_indexes(routes), prefix_demands(routes), prefix_learners(routes))
    await gw.membership.set_sources(effective.discovery)
    return notes


def _policy_parts(routes: list[Route], attribute: str, kind: type[T]) -> dict[str, T]:
    """Each route's policy ``attribute``, for the policies whose one is a ``kind``."""
    parts = {}
    for route in routes:
        part = getattr(route.runner.policy, attribute, None)
        if isinstance(part, kind):
            parts[route.name] = part
    return parts


def prefix_indexes(routes: list[Route]) -> dict[str, AffinityIndex]:
    """Each route's affinity index, for the policies that have one (shared through Redis)."""
    return _policy_parts(routes, "index", AffinityIndex)


def prefix_learners(routes: list[Route]) -> dict[str, VarianceLearner]:
    """Each route's normalization learner (places seen to vary), for routes that normalize prompts."""
    return {route.name: route.pipeline.normalizer.learner for route in routes if route.pipeline is not None}


def prefix_demands(routes: list[Route]) -> dict[str, HeadDemand]:
    """Each route's shared-head start counts, for the policies that keep them (shared through Redis)."""
    return _policy_parts(routes, "demand", HeadDemand)


def _update_route_metrics(gw: Gateway, old_routes: list[Route]) -> None:
    metrics = gw.metrics
    current = {r.name: r for r in gw.routes.routes}
    for route in old_routes:
        now = current.get(route.name)
        if now is None or now.policy != route.policy:
            with contextlib.suppress(KeyError):
                metrics.route_info.remove(route.name, route.policy)
        if now is None:
            for replica in route.runner.replicas:
                with contextlib.suppress(KeyError):
                    metrics.route_replica_info.remove(route.name, replica.name)
    for route in gw.routes.routes:
        metrics.declare_route(route.name, route.policy, [r.name for r in route.runner.replicas])
