"""The Kubernetes API as discovery uses it: service-account auth, and one collection kept current.

Shared by the EndpointSlice source (``kubernetes.py``) and the InferencePool source
(``inference_pool.py``), so both authenticate, list, watch, resync and back off the same way.

- The pod's service account authenticates; its token file is read again at every request
  (bound tokens rotate), its ``ca.crt`` verifies the API server.
- :class:`ListWatch` is the client-go informer's loop, reduced: list (remember
  ``resourceVersion``), report, then watch from that version; ADDED / MODIFIED / DELETED events
  update the object set and report again; a ``410 Gone`` (version too old), a failed call or
  ``resync_s`` elapsed: list again; failures back off (1 s doubling to 30 s) and keep the last
  report — an API-server outage must not empty a pool.
- Refusals say what to fix: a 403 names the verb, resource and namespace the Role lacks, a 404
  on a custom resource says its CRD is missing (``failing`` in ``/admin/stats``, and doctor).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp

from gateway.discovery.settings import KubeApiSettings
from gateway.discovery.source import Endpoint, Publish
from gateway.discovery.stats import SourceStats

log = logging.getLogger("prefix_gateway.discovery")

MAX_BACKOFF_S = 30.0


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class ApiRefused(RuntimeError):
    """The API server answered an error status; the message says what to fix."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class KubeClient:
    """Where the API server is, who we are to it (token, CA) and which namespace we read."""

    def __init__(self, settings: KubeApiSettings, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        sa = Path(settings.service_account_dir)
        self.api_url = settings.api_url or in_cluster_url(env)
        self.namespace = settings.namespace or read_text(sa / "namespace") or "default"
        self._token_file = sa / "token"
        ca = sa / "ca.crt"
        self.ssl: ssl.SSLContext | None = ssl.create_default_context(cafile=str(ca)) if ca.is_file() else None

    def headers(self) -> dict[str, str]:
        token = read_text(self._token_file)
        headers = {"accept": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        return headers

    def refusal(self, status: int, verb: str, resource: str, body: str) -> ApiRefused:
        """An :class:`ApiRefused` whose message tells an operator what to change."""
        where = f"in namespace {self.namespace}"
        if status == 403:
            message = (
                f"forbidden: the service account may not {verb} {resource} {where} "
                f"(grant get/list/watch on it in the Role bound to the pod's service account)"
            )
        elif status == 401:
            message = f"unauthorized: the API server refused the service-account token ({verb} {resource})"
        elif status == 404:
            message = f"{verb} {resource}: not found (404) — is its CRD installed, at this API version?"
        else:
            message = f"{verb} {resource}: HTTP {status}"
        detail = _status_message(body)
        return ApiRefused(status, f"{message}: {detail}" if detail else message)


ObjectsChanged = Callable[[Mapping[str, Mapping[str, Any]]], Awaitable[None]]


class ListWatch:
    """One collection (``path`` + query ``params``) listed, watched and kept in ``objects``.

    ``on_change`` runs after every list and every event that changed the set; ``on_health`` after
    ``failing`` changed (the owner folds it into its source's stats).
    """

    def __init__(
        self,
        source: str,
        client: KubeClient,
        resource: str,
        path: str,
        params: Mapping[str, str],
        settings: KubeApiSettings,
        stats: SourceStats,
        on_change: ObjectsChanged,
        on_health: Callable[[], None],
    ) -> None:
        self.source = source
        self.client = client
        self.resource = resource
        self.path = path
        self.params = dict(params)
        self.settings = settings
        self.stats = stats
        self.on_change = on_change
        self.on_health = on_health
        self.objects: dict[str, Mapping[str, Any]] = {}
        self.resource_version = ""
        self.failing: str | None = None

    def _url(self, **params: str) -> str:
        return f"{self.client.api_url}{self.path}?{urlencode({**self.params, **params})}"

    async def list(self, session: aiohttp.ClientSession) -> None:
        async with session.get(self._url(), headers=self.client.headers(), ssl=self.client.ssl) as response:
            if response.status != 200:
                raise self.client.refusal(response.status, "list", self.resource, await response.text())
            body = await response.json(content_type=None)
        items = body.get("items") if isinstance(body, Mapping) else None
        self.objects = {object_key(item): item for item in items or [] if isinstance(item, Mapping)}
        self.resource_version = str((body.get("metadata") or {}).get("resourceVersion") or "")
        self.stats.updates += 1

    async def watch(self, session: aiohttp.ClientSession, until: float) -> None:
        """Apply watch events until the server ends the watch or ``until`` (monotonic) passes."""
        timeout = max(1, min(self.settings.watch_timeout_s, int(until - time.monotonic())))
        url = self._url(
            watch="1", resourceVersion=self.resource_version, allowWatchBookmarks="true", timeoutSeconds=str(timeout)
        )
        client_timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout + 30)
        headers, context = self.client.headers(), self.client.ssl
        async with session.get(url, headers=headers, ssl=context, timeout=client_timeout) as response:
            if response.status == 410:
                raise WatchExpired()
            if response.status != 200:
                raise self.client.refusal(response.status, "watch", self.resource, await response.text())
            async for raw in response.content:
                line = raw.strip()
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise WatchExpired()
                    raise RuntimeError(f"watch {self.resource}: {obj.get('message') or obj}")
                version = (obj.get("metadata") or {}).get("resourceVersion")
                if version:
                    self.resource_version = str(version)
                if kind in ("ADDED", "MODIFIED"):
                    self.objects[object_key(obj)] = obj
                elif kind == "DELETED":
                    self.objects.pop(object_key(obj), None)
                else:  # BOOKMARK: only the version moves
                    continue
                self.stats.updates += 1
                await self.on_change(self.objects)
                if time.monotonic() >= until:
                    return

    def _set_failing(self, failing: str | None) -> None:
        if failing != self.failing:
            self.failing = failing
            self.on_health()

    async def run(self, session: aiohttp.ClientSession) -> None:
        """List and watch until cancelled; errors keep the last report and back off."""
        backoff = 1.0
        while True:
            try:
                await self.list(session)
                await self.on_change(self.objects)
                if self.failing is not None:
                    log.info("discovery %s: %s answer again", self.source, self.resource)
                self._set_failing(None)
                backoff = 1.0
                resync_at = time.monotonic() + self.settings.resync_s
                while time.monotonic() < resync_at:
                    await self.watch(session, resync_at)
            except WatchExpired:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the last report; retry with backoff
                self.stats.errors += 1
                message = str(exc) or type(exc).__name__
                if self.failing is None:
                    log.warning(
                        "discovery %s: %s unavailable (%s); keeping the last answer",
                        self.source,
                        self.resource,
                        message,
                    )
                self._set_failing(message)
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)


class KubeSource:
    """What the Kubernetes sources share: their name, stats, API client and how they build a :class:`ListWatch`."""

    settings: KubeApiSettings

    def __init__(
        self, name: str, settings: KubeApiSettings, stats: SourceStats, environ: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.settings = settings
        self.stats = stats
        self.client = KubeClient(settings, environ)
        self._publish: Publish | None = None

    def list_watch(self, resource: str, path: str, params: Mapping[str, str], on_change: ObjectsChanged) -> ListWatch:
        return ListWatch(
            self.name, self.client, resource, path, params, self.settings, self.stats, on_change, self._health
        )

    def endpoints(self) -> list[Endpoint]:
        raise NotImplementedError

    def _health(self) -> None:
        """Fold the watches' ``failing`` into the source's stats."""
        raise NotImplementedError

    async def report(self, _objects: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Publish what the source sees now (an ``on_change`` of its watches)."""
        assert self._publish is not None, "run() sets the publisher"
        await self._publish(self.endpoints())


def object_key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return str(meta.get("name") or meta.get("uid") or id(obj))


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def in_cluster_url(env: Mapping[str, str]) -> str:
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return "https://kubernetes.default.svc"
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def _status_message(body: str) -> str:
    """The ``message`` of a ``Status`` body (what the API server says), else a short excerpt."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.strip()[:200]
    if isinstance(parsed, Mapping) and isinstance(parsed.get("message"), str):
        return parsed["message"][:300]
    return ""
