"""Snapshot catch-up: a gateway process that joins gets its peers' recent affinity, not a blank index."""

from __future__ import annotations

import random
import time
import uuid

import pytest

from gateway.config import HealthSettings, ReplicaConfig
from gateway.replicas.pool import Replica
from gateway.routing.affinity import AffinityIndex, KeyWeights
from gateway.routing.starts import HeadDemand
from gateway.state.affinity_sync import AffinitySync, SyncStats
from gateway.state.catchup import ALONE_S, CatchUp, snapshot_records
from gateway.state.peer_load import PeerLoad
from tests.polling import until
from tests.state.kv_model import model_kv

NAMES = ["r0", "r1", "r2"]


def index() -> AffinityIndex:
    idx = AffinityIndex(10_000, stride=4)
    idx.set_members(NAMES)
    return idx


def chains(n: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    head = [rnd.getrandbits(64) for _ in range(8)]  # a shared system prompt
    return [head + [rnd.getrandbits(64) for _ in range(rnd.randint(4, 40))] for _ in range(n)]


def test_a_snapshot_rebuilds_matches_extents_and_recency() -> None:
    source = index()
    convs = chains(30, 1)
    for i, keys in enumerate(convs):
        source.record(NAMES[i % 3], keys, prompt_tokens=1000 + i)
    target = index()
    for record in snapshot_records({"chat": source}, keys_total=100_000):
        assert record.route == "chat" and record.weights is None  # no modelled cache: nothing to weigh
        target.record_stored(record.replica, record.keys, record.prompt_tokens)
    for i, keys in enumerate(convs):
        assert target.match(keys, NAMES) == source.match(keys, NAMES)
        deepest = source.stored_keys(keys)[0]
        assert target.extent(NAMES[i % 3], deepest) == source.extent(NAMES[i % 3], deepest) == 1000 + i
    assert list(target._lru["r0"]) == list(source._lru["r0"])  # the same recency order


def test_a_snapshot_fills_a_newcomers_kv_cache_model_as_the_senders() -> None:
    """Text keys past the window stand for ~1,000 tokens each, window keys for a stride of
    blocks: a snapshot carries what each weighs, so the newcomer's model holds what the
    sender's does (with even weights it would hold a different amount and evict otherwise)."""

    source = model_kv(index(), 400_000, NAMES)
    for i, keys in enumerate(chains(30, 3)):
        blocks = min(len(keys), 20)  # the first 20 keys are token blocks of 16, the rest ~900 tokens each

        def tokens_at(depth: int, blocks: int = blocks) -> int:
            return depth * 16 if depth <= blocks else blocks * 16 + (depth - blocks) * 900

        source.record(
            NAMES[i % 3], keys, prompt_tokens=tokens_at(len(keys)) + 500, tokens_at=tokens_at, blocks=(blocks, 16)
        )
    target = model_kv(index(), 400_000, NAMES)
    records = snapshot_records({"chat": source}, keys_total=100_000)
    assert any(record.weights and max(record.weights) >= 900 for record in records)
    for record in records:
        target.record_stored(record.replica, record.keys, record.prompt_tokens, KeyWeights.of(record.weights))
    for name in NAMES:
        assert target.tokens_held(name) == source.tokens_held(name) > 30_000


def test_a_snapshot_is_bounded() -> None:
    source = index()
    for i, keys in enumerate(chains(200, 2)):
        source.record(NAMES[i % 3], keys)
    records = snapshot_records({"chat": source}, keys_total=300)
    assert 0 < sum(len(record.keys) for record in records) <= 300
    assert snapshot_records({"chat": index()}, keys_total=300) == []  # nothing learned: nothing sent


def fleet() -> dict[str, Replica]:
    return {
        name: Replica(ReplicaConfig(name=name, url=f"http://h:{i + 1}"), object(), HealthSettings())  # type: ignore[arg-type]
        for i, name in enumerate(NAMES)
    }


def process(
    redis_url: str, channel: str, idx: AffinityIndex, demand: HeadDemand | None = None
) -> tuple[AffinitySync, CatchUp]:
    load = PeerLoad(fleet(), ttl_s=2.0)
    demands = {"chat": demand} if demand is not None else None
    sync = AffinitySync(
        redis_url, channel, {"chat": idx}, batch_interval_s=0.001, peer_load=load, load_interval_s=0.05, demands=demands
    )
    catch_up = CatchUp(sync, keys_total=10_000, min_interval_s=0.0, delay_s=0.2, ready_wait_s=30)
    load.on_new_peer = catch_up.new_peer
    return sync, catch_up


async def test_a_process_that_joins_learns_its_peers_recent_affinity(redis_url: str) -> None:
    channel = f"test-catchup-{uuid.uuid4().hex}"
    old_index, new_index = index(), index()
    old_demand, new_demand = HeadDemand(256), HeadDemand(256)
    old, old_catch_up = process(redis_url, channel, old_index, old_demand)
    await old.start()
    try:
        convs = chains(20, 3)
        for i, keys in enumerate(convs):
            old_index.record(NAMES[i % 3], keys, prompt_tokens=500)
        await until(lambda: old.stats.published == 20, what="records published to nobody")
        for head in [1] * 12 + [2] * 4:  # conversations started behind two shared heads
            old_demand.record(head)
        new, new_catch_up = process(redis_url, channel, new_index, new_demand)  # starts after all of that
        await new.start()
        new_catch_up.start(time.monotonic())
        try:
            await until(lambda: old_catch_up.sent == 1, what="the old process answering the newcomer")
            # ready once the snapshot has ended, and by then it knows everything the old one does
            await until(lambda: new_catch_up.readiness(time.monotonic())[0], what="the newcomer ready")
            assert new_catch_up.readiness(time.monotonic()) == (True, "snapshot received")
            assert all(new_index.match(k, NAMES) == old_index.match(k, NAMES) for k in convs)
            # and it judges the shared heads by the fleet's recent starts, not by none
            assert new_demand.recent_starts() == pytest.approx(old_demand.recent_starts(), rel=0.01)
            assert new_demand.share(1, prior=1) == pytest.approx(old_demand.share(1, prior=1), rel=0.01)
            assert new_index.match(convs[4], NAMES)[NAMES[4 % 3]] == len(convs[4])  # its whole conversation
        finally:
            await new.stop()
    finally:
        await old.stop()


class _Sync:
    """What CatchUp reads of an AffinitySync: its indexes and its publish queue."""

    def __init__(self, idx: AffinityIndex) -> None:
        self.indexes = {"chat": idx}
        self.demands: dict[str, object] = {}
        self.learners: dict[str, object] = {}
        self.offered: list[int] = []

    def offer(self, records: list[object], demand: object = None, varies: object = ()) -> None:
        self.offered.append(len(records))


async def test_a_newcomer_within_the_interval_gets_a_deferred_snapshot_and_empty_ones_do_not_count() -> None:
    idx = index()
    sync = _Sync(idx)
    catch_up = CatchUp(sync, keys_total=1000, min_interval_s=0.5, delay_s=0.01)
    catch_up.new_peer("a")  # peers meeting at startup: nothing learned, only the end mark sent
    await until(lambda: not catch_up._scheduled, what="the empty send")
    assert sync.offered == [0] and catch_up.sent == 0
    for i, keys in enumerate(chains(6, 4)):
        idx.record(NAMES[i % 3], keys)
    catch_up.new_peer("b")  # the empty one did not start the interval: sent at once
    await until(lambda: catch_up.sent == 1, what="b's snapshot")
    catch_up.new_peer("c")  # 10 ms later, inside the 0.5 s interval: deferred, not dropped
    catch_up.new_peer("d")  # joins the pending send
    assert catch_up._scheduled and catch_up.sent == 1
    await until(lambda: catch_up.sent == 2, timeout=5.0, what="c's deferred snapshot")
    assert len(sync.offered) == 3


class _Heard:
    """What ``CatchUp.readiness`` reads of an AffinitySync: when it subscribed, peers and snapshots heard."""

    def __init__(self) -> None:
        self.subscribed_at: float | None = None
        self.stats = SyncStats()


def test_a_newcomer_is_ready_once_a_snapshot_ends_or_when_alone_or_after_the_cap() -> None:
    def fresh(wait: float = 8.0) -> tuple[_Heard, CatchUp]:
        heard = _Heard()
        catch_up = CatchUp(heard, ready_wait_s=wait)
        catch_up.start(100.0)
        return heard, catch_up

    heard, catch_up = fresh()
    assert catch_up.readiness(101.0) == (False, "waiting for the peers' catch-up snapshot")  # Redis not yet
    heard.subscribed_at, heard.stats.peers = 100.2, 2
    assert not catch_up.readiness(100.2 + ALONE_S + 1)[0]  # peers are there: wait for their snapshot
    heard.stats.snapshots_heard = 1
    assert catch_up.readiness(103.0) == (True, "snapshot received")
    heard.stats.snapshots_heard = 0
    assert catch_up.readiness(104.0)[0]  # decided for good: a later drop of peers changes nothing

    heard, catch_up = fresh()
    heard.subscribed_at = 100.1
    assert not catch_up.readiness(100.1 + ALONE_S / 2)[0]  # peers report every second: not yet alone
    assert catch_up.readiness(100.1 + ALONE_S) == (True, "no peers")

    heard, catch_up = fresh(wait=5.0)
    assert not catch_up.readiness(104.9)[0]  # Redis unreachable: not ready ...
    assert catch_up.readiness(105.0) == (True, "gave up waiting")  # ... but never longer than the cap

    assert CatchUp(_Heard(), ready_wait_s=0).readiness(0.0) == (True, "not waiting")
    assert CatchUp(_Heard()).readiness(0.0) == (True, "not waiting")  # not started: not a joining process
