"""Two gateways sharing state through a Redis that goes away mid-run and comes back."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator

import pytest
from fault_helpers import Load, gateway, wait_for

from gateway.sim.launcher import ReplicaGroup
from tests.state.redis_proxy import FlakyProxy


class ProxyThread:
    """A :class:`FlakyProxy` on its own event loop, driven from the (synchronous) test."""

    def __init__(self, redis_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxy = FlakyProxy(redis_url)

    def call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def redis_proxy(redis_url: str) -> Iterator[ProxyThread]:
    proxy = ProxyThread(redis_url)
    proxy.call(proxy.proxy.up())
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.mark.slow
def test_redis_killed_and_back_with_two_gateways(fleet: ReplicaGroup, redis_proxy: ProxyThread) -> None:
    """Requests never depend on Redis: 0 failures while it is away, and sharing resumes."""
    state = {
        "backend": "redis",
        "redis_url": f"redis://127.0.0.1:{redis_proxy.proxy.port}/0",
        "channel": f"test-faults-{uuid.uuid4().hex}",
    }
    routes = [{"name": "main", "policy": "prefix"}]
    with gateway(fleet.urls, state=state, routes=routes) as a, gateway(fleet.urls, state=state, routes=routes) as b:
        syncs = [a.gateway.state_sync, b.gateway.state_sync]
        assert all(s is not None for s in syncs)
        wait_for(lambda: all(s.stats.connected for s in syncs), timeout=20, what="both gateways subscribed")
        loads = [Load(gw.openai_base_url, concurrency=2, stream_share=0.5, max_tokens=5).start() for gw in (a, b)]
        try:
            wait_for(lambda: b.gateway.state_sync.stats.applied > 0, timeout=20, what="a record shared")
            redis_proxy.call(redis_proxy.proxy.down())
            wait_for(lambda: not any(s.stats.connected for s in syncs), timeout=20, what="both see Redis gone")
            for load in loads:
                load.wait_done(10)  # traffic flows without Redis
            redis_proxy.call(redis_proxy.proxy.up())  # same port
            wait_for(lambda: all(s.stats.connected for s in syncs), timeout=30, what="both resubscribed")
            applied = b.gateway.state_sync.stats.applied
            wait_for(lambda: b.gateway.state_sync.stats.applied > applied, timeout=20, what="sharing resumed")
            for load in loads:
                load.wait_done(5)
        finally:
            stopped = [load.stop() for load in loads]
        assert all(stopped)
        for load in loads:
            assert load.tally.client_failures == 0 and load.tally.hung == 0, load.tally.as_dict()
