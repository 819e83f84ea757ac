"""A Redis that goes dark mid-run (accepts, never answers) under load, with per-key limits and
shared state both on it: no request fails, and once the limits' breaker is open a request
costs about what it did with a healthy Redis (issue target: at most 5 ms more at p50)."""

from __future__ import annotations

import statistics
import time
import uuid

import pytest
import redis
from fault_helpers import MODEL, Load, gateway, sdk, wait_for

from gateway.sim.launcher import ReplicaGroup
from tests.blackhole import switchable_redis

SAMPLES = 40


def _latencies_ms(client: object, n: int) -> list[float]:
    """``n`` sequential one-token completions, each timed end to end (ms)."""
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        client.chat.completions.create(  # type: ignore[attr-defined]
            model=MODEL, messages=[{"role": "user", "content": f"latency probe {i}"}], max_tokens=1
        )
        out.append((time.perf_counter() - t0) * 1000)
    return out


@pytest.mark.slow
def test_blackholed_redis_under_load_with_limits_and_shared_state(fleet: ReplicaGroup, redis_url: str) -> None:
    direct = redis.Redis.from_url(redis_url)
    with switchable_redis(redis_url, mode="forward") as hole:
        state = {"backend": "redis", "redis_url": hole.url, "channel": f"test-faults-{uuid.uuid4().hex}"}
        limits = {
            "per_key_requests_per_s": 100_000,
            "per_key_burst": 100_000,
            "per_key_concurrency": 1000,
            # above the 50 ms default: here Redis sits behind a Python proxy sharing a busy test
            # machine with the load, and a healthy phase that trips would measure nothing
            "redis_timeout_ms": 250,
        }
        routes = [{"name": "main", "policy": "prefix"}]
        with gateway(fleet.urls, state=state, routes=routes, limits=limits) as gw:
            sync, limiter = gw.gateway.state_sync, gw.gateway.limiter
            assert sync is not None and limiter.breaker is not None
            wait_for(lambda: sync.stats.connected, timeout=20, what="shared state subscribed")
            client = sdk(gw)
            load = Load(gw.openai_base_url, concurrency=4, stream_share=0.5, max_tokens=5).start()
            try:
                load.wait_done(20, timeout_s=30)
                healthy = _latencies_ms(client, SAMPLES)
                # the limits really were in Redis (the client's bucket is there)
                assert direct.exists(f"{state['channel']}:limits:rate:a:127.0.0.1")
                hole.mode = "blackhole"
                wait_for(lambda: limiter.breaker.is_open, timeout=20, what="the limits' breaker open")
                load.wait_done(20, timeout_s=30)
                dark = _latencies_ms(client, SAMPLES)
                load.wait_done(20, timeout_s=30)
            finally:
                stopped = load.stop()
            snapshot = gw.gateway.stats_snapshot()["limits"]
    direct.close()
    added = statistics.median(dark) - statistics.median(healthy)
    print(
        f"\nblackholed Redis: p50 {statistics.median(healthy):.1f} ms healthy -> {statistics.median(dark):.1f} ms "
        f"with the breaker open (added p50 {added:+.1f} ms, issue target <= 5 ms); "
        f"breaker {snapshot['redis_breaker']}, fallbacks {snapshot['redis_fallbacks']}, load {load.tally.as_dict()}"
    )
    assert stopped
    assert load.tally.client_failures == 0 and load.tally.hung == 0, load.tally.as_dict()
    assert snapshot["redis_fallbacks"] > 0
    # generous (a shared CI machine is noisy); before the breaker each request added 2 s
    assert added < 250, f"added p50 {added:.1f} ms"
