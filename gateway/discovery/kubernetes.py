"""Kubernetes discovery: EndpointSlices by label selector, listed and watched through the API server.

RBAC in ``k8s/`` grants ``list`` and ``watch`` on ``discovery.k8s.io/endpointslices``; auth,
list+watch, resync and backoff are ``gateway.discovery.kube_client``'s (shared with the
InferencePool source).

An endpoint counts only while ``conditions.ready`` is not false (unset means ready, as the
API documents); a terminating pod turns not-ready, so it drains before it is deleted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp

from gateway.discovery.kube_client import KubeSource
from gateway.discovery.settings import KubernetesSettings
from gateway.discovery.source import Endpoint, Publish, base_url, replica_name
from gateway.discovery.stats import SourceStats


def slice_endpoints(source: str, obj: Mapping[str, Any], settings: KubernetesSettings) -> list[Endpoint]:
    """The ready endpoints of one EndpointSlice object, as replicas of ``source``."""
    ports = obj.get("ports") or []
    port = settings.port
    if port is None:
        chosen = next((p for p in ports if settings.port_name is None or p.get("name") == settings.port_name), None)
        port = chosen.get("port") if isinstance(chosen, Mapping) else None
    if not isinstance(port, int):
        return []
    found = []
    for ep in obj.get("endpoints") or []:
        if not isinstance(ep, Mapping):
            continue
        conditions = ep.get("conditions") or {}
        if conditions.get("ready") is False:  # unset means ready
            continue
        addresses = ep.get("addresses") or []
        if not addresses or not isinstance(addresses[0], str):
            continue
        address = addresses[0]  # the API: addresses of one endpoint are fungible, use the first
        ref = ep.get("targetRef") or {}
        ident = ref.get("name") if ref.get("kind") == "Pod" and isinstance(ref.get("name"), str) else address
        found.append(Endpoint(replica_name(source, ident), base_url(settings.scheme, address, port)))
    return found


class KubernetesSource(KubeSource):
    """Reports the ready endpoints of every EndpointSlice matching ``label_selector``."""

    settings: KubernetesSettings

    def __init__(
        self, name: str, settings: KubernetesSettings, stats: SourceStats, environ: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(name, settings, stats, environ)
        self.slices = self.list_watch(
            "endpointslices.discovery.k8s.io",
            f"/apis/discovery.k8s.io/v1/namespaces/{self.client.namespace}/endpointslices",
            {"labelSelector": settings.label_selector},
            self.report,
        )

    def endpoints(self) -> list[Endpoint]:
        by_name: dict[str, Endpoint] = {}
        for key in sorted(self.slices.objects):
            for ep in slice_endpoints(self.name, self.slices.objects[key], self.settings):
                by_name.setdefault(ep.name, ep)
        return sorted(by_name.values(), key=lambda e: e.name)

    def _health(self) -> None:
        self.stats.failing = self.slices.failing

    async def run(self, publish: Publish) -> None:
        self._publish = publish
        async with aiohttp.ClientSession() as session:
            await self.slices.run(session)
