"""InferencePool discovery: the pods of one Gateway API Inference Extension ``InferencePool``.

When the gateway runs as an endpoint picker, the pool object is the operator's single source of
truth for which pods serve the model (``inference.networking.k8s.io/v1``):

- ``spec.selector.matchLabels`` selects pods in the pool's namespace;
- ``spec.targetPorts`` (1..8 ``{number}``) are the ports; every ``podIP:number`` is its own
  endpoint, as the upstream picker counts them (one engine per port, e.g. data parallel).

Two list+watch loops (``gateway.discovery.kube_client``): the pool object by name, and the pods
its selector matches.  A selector change restarts the pod watch; a port change only reports
again.  A pod counts while it has a ``podIP``, its ``Ready`` condition is ``True`` and it is not
terminating (``deletionTimestamp`` set): it drains before it is gone.

A pool that cannot be read as v1 (no selector, no ports, another API version) keeps the last
report and says why in ``failing``; a pool that is deleted reports no replicas (nothing may be
routed to a pool that does not exist) and says so too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.discovery.kube_client import KubeSource, ListWatch
from gateway.discovery.settings import InferencePoolSettings
from gateway.discovery.source import Endpoint, Publish, base_url, replica_name
from gateway.discovery.stats import SourceStats
from gateway.tasks import cancel_and_wait

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
MAX_PORTS = 8  # the CRD's maxItems


class InvalidPool(ValueError):
    """The pool object cannot be read as a v1 InferencePool; the message says why."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What discovery needs of a pool: whom it selects and on which ports."""

    match_labels: tuple[tuple[str, str], ...]
    ports: tuple[int, ...]

    @property
    def label_selector(self) -> str:
        return ",".join(f"{key}={value}" for key, value in self.match_labels)


def pool_spec(obj: Mapping[str, Any], where: str) -> PoolSpec:
    """The selector and ports of a v1 InferencePool object, or :class:`InvalidPool`."""
    api_version = obj.get("apiVersion")
    if api_version is not None and api_version != API_VERSION:
        raise InvalidPool(f"InferencePool {where} is {api_version}; this gateway reads {API_VERSION}")
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise InvalidPool(f"InferencePool {where} has no spec")
    if "targetPortNumber" in spec:
        raise InvalidPool(
            f"InferencePool {where} has spec.targetPortNumber (the v1alpha2 API): v1 pools list spec.targetPorts"
        )
    selector = spec.get("selector")
    labels = selector.get("matchLabels") if isinstance(selector, Mapping) else None
    if not isinstance(labels, Mapping) or not labels:
        raise InvalidPool(
            f"InferencePool {where} has no spec.selector.matchLabels: it would select no pods (or every pod)"
        )
    if not all(isinstance(k, str) and k and isinstance(v, str) for k, v in labels.items()):
        raise InvalidPool(f"InferencePool {where}: spec.selector.matchLabels must map label names to strings")
    raw_ports = spec.get("targetPorts")
    if not isinstance(raw_ports, list) or not raw_ports:
        raise InvalidPool(f"InferencePool {where} has no spec.targetPorts: no port to send requests to")
    ports: list[int] = []
    for entry in raw_ports:
        number = entry.get("number") if isinstance(entry, Mapping) else None
        if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= 65535:
            raise InvalidPool(f"InferencePool {where}: spec.targetPorts entry {entry!r} has no valid number")
        if number in ports:
            raise InvalidPool(f"InferencePool {where}: port {number} is listed twice in spec.targetPorts")
        ports.append(number)
    if len(ports) > MAX_PORTS:
        raise InvalidPool(f"InferencePool {where}: {len(ports)} targetPorts, at most {MAX_PORTS}")
    return PoolSpec(tuple(sorted(labels.items())), tuple(ports))


def pod_address(pod: Mapping[str, Any]) -> str | None:
    """The pod's IP while it may take requests: Ready, not terminating; else ``None``."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if not isinstance(meta, Mapping) or not isinstance(status, Mapping) or meta.get("deletionTimestamp"):
        return None
    ip = status.get("podIP")
    if not isinstance(ip, str) or not ip:
        return None
    conditions = status.get("conditions") or []
    ready = any(isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ip if ready else None


def pool_endpoints(source: str, pods: Mapping[str, Mapping[str, Any]], spec: PoolSpec, scheme: str) -> list[Endpoint]:
    """One replica per (ready pod, target port), named ``source-<pod>-<port>`` (stable as ports come and go)."""
    found = []
    for key in sorted(pods):
        ip = pod_address(pods[key])
        if ip is None:
            continue
        for port in spec.ports:
            found.append(Endpoint(replica_name(source, f"{key}-{port}"), base_url(scheme, ip, port)))
    return sorted(found, key=lambda e: e.name)


class InferencePoolSource(KubeSource):
    """Reports the ready pods of one InferencePool, one replica per target port."""

    settings: InferencePoolSettings

    def __init__(
        self, name: str, settings: InferencePoolSettings, stats: SourceStats, environ: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(name, settings, stats, environ)
        self.where = f"{self.client.namespace}/{settings.name}"
        self.spec: PoolSpec | None = None
        self.problem: str | None = None  # what is wrong with the pool object itself
        self.pool = self.list_watch(
            f"inferencepools.{GROUP}",
            f"/apis/{GROUP}/{VERSION}/namespaces/{self.client.namespace}/inferencepools",
            {"fieldSelector": f"metadata.name={settings.name}"},
            self._pool_changed,
        )
        self.pods: ListWatch | None = None
        self._pods_task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def endpoints(self) -> list[Endpoint]:
        if self.spec is None or self.pods is None:
            return []
        return pool_endpoints(self.name, self.pods.objects, self.spec, self.settings.scheme)

    def _health(self) -> None:
        watches = [self.pool, self.pods] if self.pods is not None else [self.pool]
        problems = [w.failing for w in watches if w.failing] + ([self.problem] if self.problem else [])
        self.stats.failing = "; ".join(problems) or None

    def _set_problem(self, problem: str | None) -> None:
        self.problem = problem
        self._health()

    async def _pool_changed(self, objects: Mapping[str, Mapping[str, Any]]) -> None:
        obj = objects.get(self.settings.name)
        if obj is None:  # deleted, or never created: nothing may be routed to it
            self.spec = None
            await self._stop_pods()
            self._set_problem(f"InferencePool {self.where} not found")
            await self.report()
            return
        try:
            spec = pool_spec(obj, self.where)
        except InvalidPool as exc:  # keep the last report: an edit gone wrong must not empty the pool
            self._set_problem(str(exc))
            return
        self._set_problem(None)
        if spec == self.spec:
            return
        selector_changed = self.spec is None or spec.match_labels != self.spec.match_labels
        self.spec = spec
        if selector_changed or self.pods is None:
            await self._start_pods(spec)
        else:  # only the ports moved
            await self.report()

    async def _start_pods(self, spec: PoolSpec) -> None:
        await self._stop_pods()
        assert self._session is not None
        self.pods = self.list_watch(
            "pods",
            f"/api/v1/namespaces/{self.client.namespace}/pods",
            {"labelSelector": spec.label_selector},
            self.report,
        )
        self._pods_task = asyncio.create_task(self.pods.run(self._session), name=f"discovery-{self.name}-pods")

    async def _stop_pods(self) -> None:
        task, self._pods_task = self._pods_task, None
        if task is not None and task is not asyncio.current_task():
            await cancel_and_wait(task)
        self.pods = None
        self._health()

    async def run(self, publish: Publish) -> None:
        self._publish = publish
        async with aiohttp.ClientSession() as session:
            self._session = session
            try:
                await self.pool.run(session)
            finally:
                with contextlib.suppress(Exception):
                    await self._stop_pods()
