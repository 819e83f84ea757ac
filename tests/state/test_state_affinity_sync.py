"""Affinity records shared between gateway processes through a real Redis (the session's: tests/redis_server.py).

Each test uses its own channel, so runs (and other tests) never see each other's messages.
"""

from __future__ import annotations

import base64
import contextlib
import json
import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.prefix.learn import VarianceLearner
from gateway.routing.affinity import AffinityIndex
from gateway.routing.sinks import NO_SINK
from gateway.routing.starts import HeadDemand
from gateway.state.affinity_sync import AffinitySync
from gateway.state.wire import Record, decode, decode_demand, decode_starts, encode
from tests.polling import until
from tests.state.kv_model import model_kv
from tests.state.redis_proxy import FlakyProxy

NAMES = ["r0", "r1", "r2", "r3"]


def index() -> AffinityIndex:
    idx = AffinityIndex(10_000, stride=4)
    idx.set_members(NAMES)
    return idx


def chain(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.getrandbits(64) for _ in range(n)]


def test_wire_format_round_trips_64_bit_keys() -> None:
    keys = [0, 1, 2**64 - 1, 12345678901234567890]
    sent = [Record("chat", "r1", keys, 9000), Record("chat", "r2", keys[:1], None)]
    pod, records = decode(encode("pod-a", sent))
    assert pod == "pod-a"
    assert records == sent


def test_weights_travel_with_their_records_in_a_field_older_versions_ignore() -> None:
    keys = chain(6, 3)
    sent = [
        Record("chat", "r1", keys, 9000),
        Record("chat", "r2", keys, 40_000, [31_000, 1_000, 1_000, 2**40]),  # clamped to u32 on the wire
    ]
    payload = encode("pod-a", sent)
    assert all(len(row) == 4 for row in json.loads(payload)["records"])  # the rows an older version reads
    _, records = decode(payload)
    assert records[0].weights is None
    assert records[1].weights == [31_000, 1_000, 1_000, 2**32 - 1]


def weights_payload(rows: object) -> bytes:
    keys = base64.b64encode(bytes(16)).decode()  # two u64 keys
    return json.dumps({"v": 1, "pod": "x", "records": [["chat", "r1", 0, keys]], "weights": rows}).encode()


@pytest.mark.parametrize(
    "rows",
    [
        "AAAA",
        [[0]],
        [[1, base64.b64encode(bytes(4)).decode()]],  # no record 1
        [[0, "not base64!"]],
        [[0, base64.b64encode(bytes(3)).decode()]],  # not whole u32s
        [[0, base64.b64encode(bytes(12)).decode()]],  # more weights than keys
        [[0, ""]],
        [[True, base64.b64encode(bytes(4)).decode()]],
    ],
)
def test_malformed_weights_are_rejected(rows: object) -> None:
    with pytest.raises(ValueError):
        decode(weights_payload(rows))


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b'{"v": 2, "pod": "x", "records": []}',
        b'{"v": 1, "pod": 7, "records": []}',
        b'{"v": 1, "pod": "x", "records": [["chat", "r1", 0]]}',
        b'{"v": 1, "pod": "x", "records": [["chat", "r1", -1, "AAAAAAAAAAA="]]}',
        b'{"v": 1, "pod": "x", "records": [["chat", "r1", 0, "not base64!"]]}',
        (
            '{"v": 1, "pod": "x", "records": [["chat", "r1", 0, "' + base64.b64encode(b"1234567").decode() + '"]]}'
        ).encode(),
    ],
)
def test_malformed_messages_are_rejected(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode(payload)


async def test_a_peer_models_the_replicas_kv_cache_as_the_recorder_does(redis_url: str) -> None:
    """A conversation's turns share their history: each turn adds only its new text to the
    replica's cache.  The records carry what each key weighs in the recorder's model, so the
    peer's model of the same replica holds the same tokens.  Without them the peer would let
    every turn's deepest key stand for the whole prompt (the turns' histories counted again
    and again) and evict the conversation it still holds."""

    a_index, b_index = model_kv(index(), 60_000, NAMES), model_kv(index(), 60_000, NAMES)
    async with connected_pair(redis_url, a_index, b_index) as (_, b):

        def tokens_at(depth: int) -> int:  # 256 token blocks of 16, then text keys of 250 tokens
            return depth * 16 if depth <= 256 else 4096 + (depth - 256) * 250

        history = chain(256 + 80, 7)
        turns = [history[: 256 + 20 + 8 * turn] for turn in range(8)]  # 9k tokens, 2k more per turn
        for n, keys in enumerate(turns, 1):
            a_index.record("r1", keys, tokens_at(len(keys)) + 300, tokens_at, (256, 16))
            await until(lambda n=n: b.stats.applied == n)
        held = a_index.tokens_held("r1")
        assert held is not None and held < 26_000  # one 23k-token conversation
        assert b_index.tokens_held("r1") == held
        assert b_index.match(turns[-1], NAMES) == a_index.match(turns[-1], NAMES) == {"r1": len(turns[-1])}


@contextlib.asynccontextmanager
async def connected_pair(
    redis_url: str, a_index: AffinityIndex, b_index: AffinityIndex
) -> AsyncIterator[tuple[AffinitySync, AffinitySync]]:
    """Two gateway processes' syncs on a fresh channel, connected; stopped on the way out."""
    channel = f"test-affinity-{uuid.uuid4().hex}"
    a = AffinitySync(redis_url, channel, {"chat": a_index}, batch_interval_s=0.001)
    b = AffinitySync(redis_url, channel, {"chat": b_index}, batch_interval_s=0.001)
    await a.start()
    await b.start()
    try:
        await until(lambda: a.stats.connected and b.stats.connected)
        yield a, b
    finally:
        await a.stop()
        await b.stop()


async def test_a_record_made_by_one_gateway_reaches_the_other(redis_url: str) -> None:
    a_index, b_index = index(), index()
    async with connected_pair(redis_url, a_index, b_index) as (a, b):
        keys = chain(64, 1)
        a_index.record("r2", keys, prompt_tokens=12_000)
        await until(lambda: b.stats.applied == 1)
        assert b_index.match(keys, NAMES) == {"r2": 64}
        assert b_index.extent("r2", keys[-1]) == 12_000
        assert a.stats.published == 1 and a.stats.applied == 0  # its own message is not applied twice
        # b does not queue its peers' records for publishing (no echo storms)
        assert not b._pending and b.stats.published == 0

        # a record for a replica b does not know is skipped, and counted
        a_index.set_members([*NAMES, "r9"])
        a_index.record("r9", chain(8, 2))
        await until(lambda: b.stats.ignored == 1)
        # a malformed message is counted, and later ones still apply
        raw = aioredis.from_url(redis_url)
        await raw.publish(b.channel, b"garbage")
        await raw.aclose()
        await until(lambda: b.stats.errors == 1)
        a_index.record("r0", chain(8, 3))
        await until(lambda: b.stats.applied == 2)
    assert a_index.sink is NO_SINK  # stop() detaches from the index


async def test_conversation_starts_behind_shared_heads_are_counted_by_every_gateway(redis_url: str) -> None:
    """Each process sees a third of the fleet's new conversations; the head-holder count must
    come from all of them (gateway.routing.starts), so starts travel with the records."""
    channel = f"test-starts-{uuid.uuid4().hex}"
    a_demand, b_demand = HeadDemand(256), HeadDemand(256)
    a_learn, b_learn = VarianceLearner(), VarianceLearner()
    a, b = (
        AffinitySync(
            redis_url, channel, {"chat": index()}, batch_interval_s=0.001, demands={"chat": d}, learners={"chat": lr}
        )
        for d, lr in ((a_demand, a_learn), (b_demand, b_learn))
    )
    await a.start()
    await b.start()
    try:
        await until(lambda: a.stats.connected and b.stats.connected)
        head, other = 0xFEDC_BA98_7654_3210, 7
        for _ in range(6):
            a_demand.record(head)
        b_demand.record(other)
        await until(lambda: b.stats.starts_applied == 6 and a.stats.starts_applied == 1)
        assert b_demand.recent_starts() == pytest.approx(a_demand.recent_starts(), rel=0.05)  # 7 each
        assert b_demand.share(head, prior=1) == pytest.approx(a_demand.share(head, prior=1), rel=0.05)
        assert not b._starts and b.stats.published == 0  # peers' starts are not published again
        # a normalization place a saw (and its value) travels too: b's other value there varies
        a_learn.record("iso_datetime", "system", "Current time: \x00Z.", "2025-03-04T05:00:00")
        await until(lambda: b.stats.varies_applied == 1)
        assert b_learn.varies("iso_datetime", "system", "Current time: \x00Z.", "2025-03-04T05:00:01")
        assert not b_learn.varies("iso_datetime", "system", "Current time: \x00Z.", "2025-03-04T05:00:00")
    finally:
        await a.stop()
        await b.stop()
    assert a_demand.sink is NO_SINK  # stop() detaches from the start counts too


def test_starts_and_demand_on_the_wire_are_validated() -> None:
    good = {"v": 1, "pod": "p", "records": [], "starts": [["chat", 2**64 - 1]]}
    assert decode_starts(good) == [("chat", 2**64 - 1)]
    for starts in ([["chat", 2**64]], [["chat", -1]], [["chat"]], "x", [[1, 2]]):
        with pytest.raises(ValueError):
            decode_starts({**good, "starts": starts})
    payload = encode("p", [], catch_up_end=True, demand={"chat": (12.5, [(3, 2.0), (2**63, 0.5)])})
    assert decode_demand(json.loads(payload)) == {"chat": (12.5, [(3, 2.0), (2**63, 0.5)])}
    for demand in ({"chat": [1]}, {"chat": [-1, []]}, {"chat": [1, [[1, -2]]]}, {"chat": [1, [[2**64, 1]]]}):
        with pytest.raises(ValueError):
            decode_demand({"demand": demand})


async def test_without_redis_the_gateway_keeps_routing_and_says_so() -> None:
    idx = index()
    sync = AffinitySync("redis://127.0.0.1:1/0", "unused", {"chat": idx}, batch_interval_s=0.001)
    await sync.start()
    try:
        keys = chain(16, 4)
        idx.record("r1", keys)  # the request path never waits on, or fails because of, Redis
        assert idx.match(keys, NAMES) == {"r1": 16}
        await until(lambda: sync.stats.errors >= 2 and sync.stats.dropped >= 1)
        assert not sync.stats.connected
    finally:
        await sync.stop()


async def test_the_pending_queue_is_bounded() -> None:
    idx = index()
    sync = AffinitySync("redis://127.0.0.1:1/0", "unused", {"chat": idx}, max_pending=3)
    for seed in range(5):  # not started: nothing is published, the queue keeps the newest 3
        idx.record("r0", chain(4, seed))
    assert sync.stats.dropped == 2
    await sync.stop()


def test_hostile_payloads_are_counted_not_raised() -> None:
    sync = AffinitySync("redis://127.0.0.1:1/0", "unused", {"chat": index()})
    for payload in (b"[" * 200_000, b" " * (9 << 20), b'{"v": 1, "pod": "x", "records": [["chat", "r0", 0, 5]]}'):
        assert sync.apply(payload) == 0
    assert sync.stats.errors == 3


@contextlib.asynccontextmanager
async def running(sync: AffinitySync) -> AsyncIterator[AffinitySync]:
    await sync.start()
    try:
        yield sync
    finally:
        await sync.stop()


async def test_sharing_resumes_after_redis_comes_back(redis_url: str) -> None:
    channel = f"test-affinity-{uuid.uuid4().hex}"
    proxy = FlakyProxy(redis_url)
    await proxy.up()
    a_index, b_index = index(), index()
    a = AffinitySync(redis_url, channel, {"chat": a_index}, batch_interval_s=0.001)
    b = AffinitySync(f"redis://127.0.0.1:{proxy.port}/0", channel, {"chat": b_index}, batch_interval_s=0.001)
    async with running(a), running(b):
        await until(lambda: a.stats.connected and b.stats.connected)
        await proxy.down()  # b loses Redis
        await until(lambda: not b.stats.connected)
        await proxy.up()
        await until(lambda: b.stats.connected, timeout=15)  # backoff retries reconnect it
        keys = chain(32, 9)
        a_index.record("r3", keys)
        await until(lambda: b_index.match(keys, NAMES) == {"r3": 32})
    await proxy.down()


def test_bad_redis_urls_are_config_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli import main
    from gateway.config import ConfigError, parse_config

    replicas = [{"name": "r0", "url": "http://127.0.0.1:9"}]
    with pytest.raises(ConfigError, match=r"state\.redis_url: .*redis://"):
        parse_config({"state": {"backend": "redis", "redis_url": "http://x"}, "replicas": replicas}, "<test>")
    path = tmp_path / "gateway.yaml"
    path.write_text('server: {port: 0}\nstate: {backend: redis}\nreplicas: [{name: r0, url: "http://127.0.0.1:9"}]\n')
    monkeypatch.setenv("PREFIX_GATEWAY_REDIS_URL", "127.0.0.1:6379")
    assert main(["serve", "--config", str(path)]) == 2
    assert "PREFIX_GATEWAY_REDIS_URL: a Redis URL must start with redis://" in capsys.readouterr().err
