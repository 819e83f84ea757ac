"""Kubernetes discovery: EndpointSlices by label selector, listed and watched through the API server.

The pod's service account authenticates (its token file is read again at every connect:
bound tokens rotate); RBAC in ``k8s/`` grants ``list`` and ``watch`` on
``discovery.k8s.io/endpointslices``.  The loop is the client-go informer's, reduced:

- list (remember ``resourceVersion``), report, then watch from that version;
- ADDED / MODIFIED / DELETED events update the slice set and report again;
- a ``410 Gone`` (version too old), a failed call or ``resync_s`` elapsed: list again;
- failures back off (1 s doubling to 30 s) and keep the last report: an API-server outage
  must not empty the pool.

An endpoint counts only while ``conditions.ready`` is not false (unset means ready, as the
API documents); a terminating pod turns not-ready, so it drains before it is deleted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp

from gateway.discovery.settings import KubernetesSettings
from gateway.discovery.source import Endpoint, Publish, base_url, replica_name
from gateway.discovery.stats import SourceStats

log = logging.getLogger("prefix_gateway.discovery")


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


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


class KubernetesSource:
    """Reports the ready endpoints of every EndpointSlice matching ``label_selector``."""

    def __init__(
        self,
        name: str,
        settings: KubernetesSettings,
        stats: SourceStats,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.stats = stats
        env = os.environ if environ is None else environ
        sa = Path(settings.service_account_dir)
        self.api_url = settings.api_url or _in_cluster_url(env)
        self.namespace = settings.namespace or _read(sa / "namespace") or "default"
        self._token_file = sa / "token"
        ca = sa / "ca.crt"
        self._ssl: ssl.SSLContext | None = ssl.create_default_context(cafile=str(ca)) if ca.is_file() else None
        self.slices: dict[str, Mapping[str, Any]] = {}
        self.resource_version = ""

    @property
    def path(self) -> str:
        return f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    def endpoints(self) -> list[Endpoint]:
        by_name: dict[str, Endpoint] = {}
        for key in sorted(self.slices):
            for ep in slice_endpoints(self.name, self.slices[key], self.settings):
                by_name.setdefault(ep.name, ep)
        return sorted(by_name.values(), key=lambda e: e.name)

    def _headers(self) -> dict[str, str]:
        token = _read(self._token_file)
        headers = {"accept": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        return headers

    def _url(self, **params: str) -> str:
        return f"{self.api_url}{self.path}?{urlencode({'labelSelector': self.settings.label_selector, **params})}"

    async def list(self, session: aiohttp.ClientSession) -> None:
        async with session.get(self._url(), headers=self._headers(), ssl=self._ssl) as response:
            if response.status != 200:
                raise RuntimeError(f"list endpointslices: HTTP {response.status}: {(await response.text())[:200]}")
            body = await response.json(content_type=None)
        items = body.get("items") or []
        self.slices = {_key(item): item for item in items if isinstance(item, Mapping)}
        self.resource_version = str((body.get("metadata") or {}).get("resourceVersion") or "")
        self.stats.updates += 1

    async def watch(self, session: aiohttp.ClientSession, publish: Publish, until: float) -> None:
        """Apply watch events until the server ends the watch or ``until`` (monotonic) passes."""
        timeout = max(1, min(self.settings.watch_timeout_s, int(until - time.monotonic())))
        url = self._url(
            watch="1",
            resourceVersion=self.resource_version,
            allowWatchBookmarks="true",
            timeoutSeconds=str(timeout),
        )
        client_timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout + 30)
        async with session.get(url, headers=self._headers(), ssl=self._ssl, timeout=client_timeout) as response:
            if response.status == 410:
                raise WatchExpired()
            if response.status != 200:
                raise RuntimeError(f"watch endpointslices: HTTP {response.status}: {(await response.text())[:200]}")
            async for raw in response.content:
                line = raw.strip()
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise WatchExpired()
                    raise RuntimeError(f"watch error: {obj.get('message') or obj}")
                version = (obj.get("metadata") or {}).get("resourceVersion")
                if version:
                    self.resource_version = str(version)
                if kind in ("ADDED", "MODIFIED"):
                    self.slices[_key(obj)] = obj
                elif kind == "DELETED":
                    self.slices.pop(_key(obj), None)
                else:  # BOOKMARK: only the version moves
                    continue
                self.stats.updates += 1
                await publish(self.endpoints())
                if time.monotonic() >= until:
                    return

    async def run(self, publish: Publish) -> None:
        backoff = 1.0
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    await self.list(session)
                    await publish(self.endpoints())
                    if self.stats.failing is not None:
                        log.info("discovery %s: the API server answers again", self.name)
                    self.stats.failing = None
                    backoff = 1.0
                    resync_at = time.monotonic() + self.settings.resync_s
                    while time.monotonic() < resync_at:
                        await self.watch(session, publish, resync_at)
                except WatchExpired:
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # keep the last report; retry with backoff
                    self.stats.errors += 1
                    if self.stats.failing is None:
                        log.warning(
                            "discovery %s: EndpointSlices unavailable (%s); keeping the last answer", self.name, exc
                        )
                    self.stats.failing = str(exc) or type(exc).__name__
                    await asyncio.sleep(backoff)
                    backoff = min(30.0, backoff * 2)


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return str(meta.get("name") or meta.get("uid") or id(obj))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _in_cluster_url(env: Mapping[str, str]) -> str:
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return "https://kubernetes.default.svc"
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
