"""Background loops: active health checks, engine-metric scrapes, and the models list.

They run beside the request path and only write fields on :class:`Replica`; the request
path never waits for them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from gateway.config import HealthSettings, ScrapeSettings
from gateway.replicas.engine import parse_engine_metrics
from gateway.replicas.pool import Replica
from gateway.tasks import cancel_and_wait
from gateway.upstream.errors import UpstreamError

log = logging.getLogger("prefix_gateway.replicas")


def _auth(replica: Replica) -> dict[str, str] | None:
    """The replica's own key on background GETs: vLLM started with ``--api-key`` refuses ``/v1/models`` without it."""
    return {"Authorization": replica.auth_header} if replica.auth_header else None


class ReplicaMonitor:
    """Owns the replicas' clients and background loops."""

    def __init__(self, replicas: Sequence[Replica], health: HealthSettings, scrape: ScrapeSettings) -> None:
        self.replicas = list(replicas)
        self.health = health
        self.scrape = scrape
        self._tasks: list[asyncio.Task[None]] = []
        self._models_cache: tuple[float, list[tuple[Replica, list[dict[str, Any]]]]] | None = None
        self._models_lock = asyncio.Lock()

    async def start(self) -> None:
        for replica in self.replicas:
            await replica.client.start()
        await self.probe_all()  # so /ready and routing reflect reality from the first request
        self._tasks.append(asyncio.create_task(self._loop(self.probe_all, self.health.interval_s), name="health"))
        if self.scrape.enabled:
            # before serving: the engine counters' baseline (summary windows) predates our traffic
            await self.scrape_all()
            self._tasks.append(asyncio.create_task(self._loop(self.scrape_all, self.scrape.interval_s), name="scrape"))

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks.clear()
        for replica in self.replicas:
            await replica.client.close()

    async def _loop(self, step: Any, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await step()
            except Exception:  # a bug here must never stop health checking
                log.exception("background step %s failed", getattr(step, "__name__", step))

    # -- active health -------------------------------------------------------------------
    async def probe(self, replica: Replica) -> None:
        try:
            status, _ = await replica.client.get(self.health.path, self.health.timeout_s, _auth(replica))
        except UpstreamError as exc:
            replica.record_probe(False, str(exc))
            return
        replica.record_probe(status == 200, f"HTTP {status}")

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas))

    # -- engine scrape -----------------------------------------------------------------
    async def scrape_one(self, replica: Replica) -> None:
        """One scrape of ``replica``'s engine metrics.  A scrape that starts failing is logged once
        (a warning: flow control, the load signals and the reported hit rate lose its numbers),
        and once more when it works again — not every interval."""
        failing = replica.engine_error
        try:
            status, body = await replica.client.get(self.scrape.path, self.scrape.timeout_s, _auth(replica))
            if status != 200:
                raise UpstreamError(f"HTTP {status}")
            replica.set_engine(parse_engine_metrics(body.decode("utf-8", "replace")))
        except (UpstreamError, ValueError) as exc:
            replica.engine_error = str(exc) or type(exc).__name__
            if failing is None:
                log.warning(
                    "replica %s: engine scrape of %s fails (%s): its queue, KV usage and cache hits are unseen "
                    "until it works again",
                    replica.name,
                    self.scrape.path,
                    replica.engine_error,
                )
            return
        if failing is not None:
            log.info("replica %s: engine scrape works again", replica.name)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape_one(r) for r in self.replicas))

    # -- models ------------------------------------------------------------------------
    async def models(self, ttl_s: float = 5.0) -> list[tuple[Replica, list[dict[str, Any]]]]:
        """``(replica, its /v1/models entries)`` for healthy replicas, cached for ``ttl_s``.

        One refresh at a time: concurrent callers after expiry wait for it instead of each
        asking every replica.
        """
        async with self._models_lock:
            now = time.monotonic()
            if self._models_cache and now - self._models_cache[0] < ttl_s:
                return self._models_cache[1]
            listing = await self._fetch_models()
            self._models_cache = (now, listing)
            return listing

    async def _fetch_models(self) -> list[tuple[Replica, list[dict[str, Any]]]]:

        async def one(replica: Replica) -> tuple[Replica, list[dict[str, Any]]] | None:
            try:
                status, body = await replica.client.get("/v1/models", self.health.timeout_s, _auth(replica))
                data = json.loads(body) if status == 200 else None
            except (UpstreamError, ValueError):
                return None
            entries = data.get("data") if isinstance(data, dict) else None
            if not isinstance(entries, list):
                return None
            return replica, [e for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)]

        results = await asyncio.gather(*(one(r) for r in self.replicas if r.healthy))
        return [r for r in results if r is not None]
