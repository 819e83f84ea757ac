"""Load shared between gateway processes: peers' in-flight and queued prefill in every policy's view."""

from __future__ import annotations

import uuid

import pytest

from gateway.config import HealthSettings, ReplicaConfig
from gateway.replicas.pool import Replica
from gateway.routing.affinity import AffinityIndex
from gateway.state.affinity_sync import AffinitySync
from gateway.state.peer_load import PeerLoad, parse_load
from tests.polling import until
from tests.state.redis_proxy import FlakyProxy


def fleet() -> dict[str, Replica]:
    return {
        name: Replica(ReplicaConfig(name=name, url=f"http://h:{i + 1}"), object(), HealthSettings())  # type: ignore[arg-type]
        for i, name in enumerate(["r0", "r1"])
    }


def test_peers_reports_add_up_and_expire() -> None:
    replicas = fleet()
    replicas["r1"].in_flight, replicas["r1"].pending_prefill_tokens = 1, 100  # this process's own
    load = PeerLoad(replicas, ttl_s=3.0)
    load.apply("pod-a", {"r1": (2, 500), "r9": (7, 7)}, now=10.0)  # r9: not ours, ignored
    load.apply("pod-b", {"r0": (1, 0), "r1": (4, 1000)}, now=11.0)
    view = replicas["r1"].view()
    assert (view.in_flight, view.pending_prefill_tokens) == (1 + 2 + 4, 100 + 500 + 1000)
    assert load.local_report() == {"r0": (0, 0), "r1": (1, 100)}  # only our own counts go out
    load.apply("pod-a", {"r1": (0, 0)}, now=12.0)  # a newer report replaces the older one
    assert replicas["r1"].view().in_flight == 1 + 4
    load.expire(now=14.5)  # pod-b's report is 3.5 s old
    assert load.peers == 1 and replicas["r1"].view().in_flight == 1 and replicas["r0"].view().in_flight == 0
    load.forget_all()
    assert replicas["r1"].peer_pending_prefill_tokens == 0


def load_sync(replicas: dict[str, Replica], url: str, channel: str) -> AffinitySync:
    """A process sharing only load (its affinity index stays empty), reporting every 20 ms."""
    index = AffinityIndex(1000)
    index.set_members(replicas)
    return AffinitySync(url, channel, {"chat": index}, peer_load=PeerLoad(replicas, ttl_s=0.5), load_interval_s=0.02)


@pytest.mark.parametrize("rows", [[1, 2], {"r0": [1]}, {"r0": [1, -1]}, {"r0": [1, "2"]}, {"r0": [True, 1]}])
def test_malformed_load_rows_are_rejected(rows: object) -> None:
    with pytest.raises(ValueError):
        parse_load(rows)


async def test_a_peers_load_reaches_this_process_through_redis_and_goes_when_it_does(redis_url: str) -> None:
    channel = f"test-load-{uuid.uuid4().hex}"
    a_replicas, b_replicas = fleet(), fleet()
    a, b = load_sync(a_replicas, redis_url, channel), load_sync(b_replicas, redis_url, channel)
    await a.start()
    await b.start()
    try:
        a_replicas["r1"].in_flight, a_replicas["r1"].pending_prefill_tokens = 3, 5000
        await until(lambda: b_replicas["r1"].view().in_flight == 3)
        assert b_replicas["r1"].view().pending_prefill_tokens == 5000
        assert b_replicas["r1"].in_flight == 0  # b's own count is untouched
        assert a_replicas["r1"].peer_in_flight == 0  # a never applies its own report
        await until(lambda: b.stats.peers == 1)
        a_replicas["r1"].in_flight, a_replicas["r1"].pending_prefill_tokens = 0, 0
        await until(lambda: b_replicas["r1"].view().in_flight == 0)
        await a.stop()  # a goes away: its last report expires
        a_replicas["r1"].in_flight = 9  # never published
        await until(lambda: b.stats.peers == 0)
        assert b_replicas["r1"].view().in_flight == 0
    finally:
        await a.stop()  # a second stop() is harmless
        await b.stop()


async def test_a_peers_load_expires_while_redis_is_unreachable(redis_url: str) -> None:
    channel = f"test-load-{uuid.uuid4().hex}"
    proxy = FlakyProxy(redis_url)
    await proxy.up()
    a_replicas, b_replicas = fleet(), fleet()
    a = load_sync(a_replicas, redis_url, channel)
    b = load_sync(b_replicas, f"redis://127.0.0.1:{proxy.port}/0", channel)
    await a.start()
    await b.start()
    try:
        a_replicas["r0"].in_flight = 2
        await until(lambda: b_replicas["r0"].view().in_flight == 2)
        await proxy.down()  # b hears nothing more: a's last report must not count forever
        await until(lambda: b_replicas["r0"].view().in_flight == 0, timeout=5)
        assert a_replicas["r0"].in_flight == 2  # a is still busy: b just cannot know any more
    finally:
        await a.stop()
        await b.stop()


def test_the_peer_ttl_must_outlive_the_report_interval() -> None:
    from gateway.config import ConfigError, parse_config

    replicas = [{"name": "r0", "url": "http://127.0.0.1:9"}]
    with pytest.raises(ConfigError, match="peer_load_ttl_s"):
        parse_config({"state": {"backend": "redis", "peer_load_ttl_s": 1.5}, "replicas": replicas}, "<test>")
    parse_config({"state": {"backend": "redis", "peer_load_ttl_s": 2.5}, "replicas": replicas}, "<test>")
