"""Subscriptions over real ZMQ sockets: discovery, gaps (replayed, or dropped and relearned),
restarts, the bound collector, membership changes and the stale fallback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.kv_events.decoder import decode_frames
from gateway.kv_events.service import KvEvents
from gateway.kv_events.settings import KvEventsSettings
from gateway.prefix.blocks import chain_block_keys, engine_seed
from tests.kv_events.frames import cleared, hashes_for, message, stored
from tests.kv_events.publisher import TestPublisher
from tests.polling import until

MODEL = "base-model"
BS = 16


@dataclass
class FakeClient:
    """Answers the two GETs the subscription makes."""

    sources: dict[str, Any] | None
    models: list[dict[str, Any]] = field(default_factory=lambda: [{"id": MODEL, "parent": None}])

    async def get(self, path: str, timeout_s: float, headers: Any = None) -> tuple[int, bytes]:
        if path == "/v1/models":
            return 200, json.dumps({"data": self.models}).encode()
        if path == "/kv_event_sources":
            return (404, b"{}") if self.sources is None else (200, json.dumps(self.sources).encode())
        return 404, b""


@dataclass
class FakeReplica:
    name: str
    client: FakeClient
    url: str = "http://127.0.0.1:9"
    auth_header: str | None = None


def _decoded(*raw: Any) -> list[Any]:
    return decode_frames(message(0, list(raw))).events


def _keys(tokens: list[int]) -> list[int]:
    return chain_block_keys(tokens, BS, engine_seed(MODEL, None, None))


def _prompt(i: int, blocks: int = 2) -> tuple[list[int], list[Any]]:
    tokens = [i * 1000 + j for j in range(blocks * BS)]
    return tokens, hashes_for(blocks, i * 100)


@pytest.fixture
async def setup() -> AsyncIterator[tuple[dict[str, FakeReplica], list[TestPublisher], list[KvEvents]]]:
    replicas: dict[str, FakeReplica] = {}
    publishers: list[TestPublisher] = []
    services: list[KvEvents] = []
    yield replicas, publishers, services
    for service in services:
        await service.stop()
    for publisher in publishers:
        publisher.close()


async def _connected(events: KvEvents, name: str, publisher: TestPublisher) -> None:
    """Past ZMQ's slow-joiner window: publish until one message arrived."""
    await until(lambda: events.ingestor.feeds.get(name) is not None and events.ingestor.feeds[name].subscribed)
    feed = events.ingestor.feeds[name]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not feed.heard:
        assert loop.time() < deadline, "no message arrived"
        publisher.publish([])
        await asyncio.sleep(0.02)


def _service(replicas: dict[str, FakeReplica], services: list[KvEvents], **settings: Any) -> KvEvents:
    events = KvEvents(KvEventsSettings(**settings), lambda: replicas)  # type: ignore[arg-type, return-value]
    services.append(events)
    return events


async def test_discovered_publisher_feeds_the_index_and_a_replayed_gap_loses_nothing(setup: Any) -> None:
    replicas, publishers, services = setup
    pub = TestPublisher(replay=True)
    publishers.append(pub)
    replicas["r0"] = FakeReplica("r0", FakeClient(pub.sources()))
    events = _service(replicas, services)
    await events.start()
    await _connected(events, "r0", pub)
    feed = events.ingestor.feeds["r0"]
    assert feed.endpoints == [pub.endpoint.replace("*", "127.0.0.1")] and feed.source == "discovery"
    assert events.mode_of("r0") == ("precise", None)

    a, b, c = _prompt(1), _prompt(2), _prompt(3)
    pub.publish([stored(a[1], a[0], BS)])
    pub.publish([stored(b[1], b[0], BS)], send=False)  # lost on the way: a gap
    pub.publish([stored(c[1], c[0], BS)])
    await until(lambda: events.index.blocks("r0") == 6, what="the gap replayed")
    assert feed.gaps == 1 and feed.replays["ok"] >= 1 and feed.replays["failed"] == 0 and feed.clears == 0
    for tokens, _ in (a, b, c):
        assert events.index.leading(_keys(tokens)) == {"r0": 2}


async def test_a_gap_without_a_replay_socket_drops_and_relearns_and_a_restart_clears(setup: Any) -> None:
    replicas, publishers, services = setup
    pub = TestPublisher(replay=False)
    publishers.append(pub)
    replicas["r0"] = FakeReplica("r0", FakeClient(pub.sources()))
    events = _service(replicas, services)
    await events.start()
    await _connected(events, "r0", pub)
    feed = events.ingestor.feeds["r0"]
    a, b, c, d = _prompt(1), _prompt(2), _prompt(3), _prompt(4)
    pub.publish([stored(a[1], a[0], BS)])
    await until(lambda: events.index.blocks("r0") == 2)
    pub.publish([stored(b[1], b[0], BS)], send=False)
    pub.publish([stored(c[1], c[0], BS)])
    await until(lambda: feed.gaps == 1)
    assert events.index.leading(_keys(a[0])) == {}  # dropped: what it held before the gap is unknown
    assert events.index.leading(_keys(c[0])) == {"r0": 2}  # relearned from the gap on
    assert feed.replays == {"ok": 0, "failed": 0}

    pub.restart()  # the engine restarted: seq 0 again
    pub.publish([stored(d[1], d[0], BS)])
    await until(lambda: feed.restarts == 1)
    assert events.index.leading(_keys(c[0])) == {}
    assert events.index.leading(_keys(d[0])) == {"r0": 2}
    pub.publish([cleared()])
    await until(lambda: events.index.blocks("r0") == 0)
    assert events.mode_of("r0") == ("precise", None)


async def test_collector_takes_engines_that_connect_by_topic(setup: Any) -> None:
    replicas, publishers, services = setup
    replicas["r7"] = FakeReplica("r7", FakeClient(None))  # publishes nowhere it could be found
    events = _service(replicas, services, collector_bind="tcp://127.0.0.1:0", discover=False)
    await events.start()
    await until(lambda: events._collector is not None and events._collector.bound is not None)
    pub = TestPublisher(replay=False, topic=b"r7", connect=events._collector.bound)
    publishers.append(pub)
    stranger = TestPublisher(replay=False, topic=b"not-a-replica", connect=events._collector.bound)
    publishers.append(stranger)
    a = _prompt(5)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while events.index.blocks("r7") == 0:
        assert loop.time() < deadline
        pub.publish([stored(a[1], a[0], BS)])
        stranger.publish([cleared()])
        await asyncio.sleep(0.02)
    assert events.index.leading(_keys(a[0])) == {"r7": 2}
    assert events.mode_of("r7") == ("precise", None)
    await until(lambda: events._collector.unknown_topic > 0)


async def test_membership_changes_add_and_remove_subscriptions(setup: Any) -> None:
    replicas, publishers, services = setup
    pub0, pub1 = TestPublisher(replay=False), TestPublisher(replay=False)
    publishers += [pub0, pub1]
    replicas["r0"] = FakeReplica("r0", FakeClient(pub0.sources()))
    events = _service(replicas, services)
    await events.start()
    await _connected(events, "r0", pub0)
    replicas["r1"] = FakeReplica("r1", FakeClient(pub1.sources()))
    events.reconcile()
    await _connected(events, "r1", pub1)
    a = _prompt(1)
    pub1.publish([stored(a[1], a[0], BS)])
    await until(lambda: events.index.blocks("r1") == 2)
    del replicas["r1"]
    events.reconcile()
    assert "r1" not in events.ingestor.feeds and events.index.leading(_keys(a[0])) == {}
    assert events.mode_of("r1") == ("approximate", "not_subscribed")


async def test_replicas_without_events_stay_approximate_and_say_why(setup: Any) -> None:
    replicas, _, services = setup
    replicas["old"] = FakeReplica("old", FakeClient(None))
    replicas["quiet"] = FakeReplica("quiet", FakeClient({"0": {"enable_kv_cache_events": False}}))
    events = _service(replicas, services, rediscover_s=0.05)
    await events.start()
    await until(lambda: all(events.ingestor.feeds.get(n) and events.ingestor.feeds[n].error for n in replicas))
    snapshot = events.snapshot()["replicas"]
    assert snapshot["old"]["mode"] == "approximate" and "HTTP 404" in snapshot["old"]["error"]
    assert snapshot["quiet"]["reason"] == "not_subscribed" and "--kv-events-config" in snapshot["quiet"]["error"]
    disabled = _service(replicas, services, enabled=False)
    assert disabled.mode_of("old") == ("approximate", "disabled")


def test_a_replica_that_stops_publishing_while_served_goes_approximate_until_it_speaks() -> None:
    now = [100.0]
    events = KvEvents(KvEventsSettings(stale_s=5), lambda: {}, clock=lambda: now[0])
    events.index.add("r0", MODEL)
    feed = events.ingestor.feed("r0")
    feed.subscribed = True
    assert events.mode_of("r0") == ("approximate", "no_events_yet")
    events.ingestor.ingest("r0", 0, 0, [])
    assert events.mode_of("r0") == ("precise", None)
    now[0] += 60  # idle for a minute: silence means nothing changed
    assert events.mode_of("r0") == ("precise", None)
    feed.routed(now[0])  # a request that stores blocks was sent there
    now[0] += 4
    assert events.mode_of("r0") == ("precise", None)
    now[0] += 2
    assert events.mode_of("r0") == ("approximate", "stale")
    events.ingestor.ingest("r0", 0, 1, [])
    assert events.mode_of("r0") == ("precise", None)


async def test_an_engine_killed_and_restarted_on_its_port_is_precise_again_without_a_gateway_restart(
    setup: Any,
) -> None:
    replicas, publishers, services = setup
    pub = TestPublisher(replay=False)
    replicas["r0"] = FakeReplica("r0", FakeClient(pub.sources()))
    events = _service(replicas, services)
    await events.start()
    await _connected(events, "r0", pub)
    feed = events.ingestor.feeds["r0"]
    a, b = _prompt(1), _prompt(2)
    pub.publish([stored(a[1], a[0], BS)])
    await until(lambda: events.index.blocks("r0") == 2)
    port = pub.port
    pub.close()  # the engine process dies: its socket is gone
    await until(lambda: feed.disconnects == 1, what="the disconnect")
    assert events.index.blocks("r0") == 0  # cleared at once: the restarted engine may stay silent
    reborn = TestPublisher(replay=False, port=port)
    publishers.append(reborn)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while events.index.blocks("r0") == 0:  # ZMQ reconnects by itself; the new engine numbers from 0
        assert loop.time() < deadline, "the restarted engine was never heard"
        reborn.restart()
        reborn.publish([stored(b[1], b[0], BS)])
        await asyncio.sleep(0.05)
    assert events.index.leading(_keys(a[0])) == {}  # what the dead engine held is gone
    assert events.index.leading(_keys(b[0])) == {"r0": 2}
    assert events.mode_of("r0") == ("precise", None)


async def test_a_replica_without_kv_event_sources_uses_the_fallback_endpoint(setup: Any) -> None:
    replicas, publishers, services = setup
    pub = TestPublisher(replay=False)
    publishers.append(pub)
    replicas["old"] = FakeReplica("old", FakeClient(None))  # GET /kv_event_sources: 404
    events = _service(replicas, services, fallback_endpoint=pub.endpoint)
    await events.start()
    await _connected(events, "old", pub)
    assert events.ingestor.feeds["old"].endpoints == [pub.endpoint.replace("*", "127.0.0.1")]
    assert events.mode_of("old") == ("precise", None)


def test_a_restart_the_scrape_saw_clears_the_replica_before_it_publishes_again() -> None:
    replica = FakeReplica("r0", FakeClient(None))
    replica.restarts_detected = {"counters_reset": 0, "rejoined": 0}  # type: ignore[attr-defined]
    events = KvEvents(KvEventsSettings(), lambda: {"r0": replica})  # type: ignore[arg-type, return-value]
    events.index.add("r0", MODEL)
    a = _prompt(1)
    events.ingestor.ingest("r0", 0, 5, _decoded(stored(a[1], a[0], BS)))
    events.notice_restarts({"r0": replica})  # type: ignore[dict-item]
    assert events.index.blocks("r0") == 2
    replica.restarts_detected["counters_reset"] = 1  # type: ignore[attr-defined]
    events.notice_restarts({"r0": replica})  # type: ignore[dict-item]
    assert events.index.blocks("r0") == 0 and events.ingestor.feeds["r0"].restarts == 1
    assert events.ingestor.ingest("r0", 0, 0, []) == "first"  # the new engine's stream


def test_a_restart_the_feed_saw_first_keeps_what_the_new_engine_published_since() -> None:
    """The engine died (its publisher disconnected: cleared then), came back, published its first
    blocks, and only then did a scrape see its counters back at zero: that late notice must not
    clear what the new engine already said it holds (the real lane's restart test)."""
    import time

    replica = FakeReplica("r0", FakeClient(None))
    replica.restarts_detected = {"counters_reset": 0, "rejoined": 0}  # type: ignore[attr-defined]
    events = KvEvents(KvEventsSettings(), lambda: {"r0": replica})  # type: ignore[arg-type, return-value]
    events.index.add("r0", MODEL)
    events.notice_restarts({"r0": replica})  # type: ignore[dict-item]
    replica.reset_after = time.monotonic()  # type: ignore[attr-defined]  # the last scrape of the old engine
    events.ingestor.ingest("r0", 0, 7, [])
    events.ingestor.ingest("r0", 0, 0, [])  # the new engine's stream: a restart the feed saw itself
    a = _prompt(1)
    events.ingestor.ingest("r0", 0, 1, _decoded(stored(a[1], a[0], BS)))
    replica.restarts_detected["counters_reset"] = 1  # type: ignore[attr-defined]  # the scrape, later
    events.notice_restarts({"r0": replica})  # type: ignore[dict-item]
    assert events.index.blocks("r0") == 2 and events.ingestor.feeds["r0"].restarts == 1


async def test_the_first_message_after_connecting_catches_up_from_the_replay_buffer(setup: Any) -> None:
    replicas, publishers, services = setup
    pub = TestPublisher(replay=True)
    publishers.append(pub)
    a, b = _prompt(1), _prompt(2)
    pub.publish([stored(a[1], a[0], BS)], send=False)  # published before the gateway listened
    replicas["r0"] = FakeReplica("r0", FakeClient(pub.sources()))
    events = _service(replicas, services)
    await events.start()
    await _connected(events, "r0", pub)
    pub.publish([stored(b[1], b[0], BS)])
    await until(lambda: events.index.blocks("r0") == 4, what="caught up")
    assert events.index.leading(_keys(a[0])) == {"r0": 2}  # learned from the replay
    assert events.ingestor.feeds["r0"].gaps == 0
