"""Concurrent /v1/models requests after the cache expired share one refresh."""

from __future__ import annotations

import asyncio
import json

from gateway.config import HealthSettings, ReplicaConfig, ScrapeSettings
from gateway.replicas.monitor import ReplicaMonitor
from gateway.replicas.pool import Replica


class CountingClient:
    """Answers GET /v1/models slowly and counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def get(self, path: str, timeout: float, headers: object = None) -> tuple[int, bytes]:
        self.calls += 1
        await asyncio.sleep(0.01)  # a slow replica, so that callers overlap
        return 200, json.dumps({"data": [{"id": "demo-model"}]}).encode()


async def test_concurrent_model_listings_fetch_once() -> None:
    client = CountingClient()
    replica = Replica(ReplicaConfig(name="r0", url="http://h:1"), client, HealthSettings())  # type: ignore[arg-type]
    monitor = ReplicaMonitor([replica], HealthSettings(), ScrapeSettings())
    listings = await asyncio.gather(*(monitor.models() for _ in range(10)))
    assert client.calls == 1
    assert all(listing[0][1] == [{"id": "demo-model"}] for listing in listings)
