"""The simulator publishes vLLM 0.32's KV cache events, and they tell what its cache really did."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest
import zmq
from kv_tap import END_SEQ, FIELDS, KVIndex, KVTap, decode, int_hash, normalize
from sim_helpers import FAST, poll

from gateway.sim import DEFAULT_MODEL
from gateway.sim.engine import EngineRequest
from gateway.sim.hashing import block_hashes, block_seed
from gateway.sim.kvevents import EventBatch, KVEventsConfig, digest_bytes, parse_kv_events_config
from gateway.sim.launcher import ReplicaGroup
from gateway.sim.options import build_options
from gateway.sim.replica import Replica
from gateway.sim.server import serve_in_thread

BLOCK = 16
EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", "topic": "kv-events"}


@contextlib.contextmanager
def tapped(**options: Any) -> Iterator[tuple[str, KVTap]]:
    config = {**EVENTS, **options.pop("events", {})}
    opts = {**FAST, "block_size": BLOCK, "enable_admin": True, "kv_events_config": config, **options}
    with serve_in_thread(opts) as url:
        tap = KVTap(url)
        try:
            tap.sync()
            yield url, tap
        finally:
            tap.close()


def complete(url: str, prompt: list[int], max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    resp = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **extra})
    resp.raise_for_status()
    return resp.json()


def state(url: str) -> dict[str, Any]:
    return httpx.get(url + "/sim/state").json()


def prompt_of(n: int, start: int) -> list[int]:
    return [start + i for i in range(n)]


def cache_content(url: str) -> dict[int, int]:
    return {int(k): v for k, v in httpx.get(url + "/sim/kv_blocks").json()["blocks"].items()}


def fresh_index(url: str, tap: KVTap) -> tuple[KVIndex, int]:
    """Start from a cache the tap saw cleared: (index of what it holds now, the next sequence).

    vLLM publishes AllBlocksCleared with its next step's batch, so a probe request follows."""
    assert httpx.post(url + "/reset_prefix_cache").json() == {"success": True}
    batch = tap.sync()
    assert batch.events[0]["type"] == "AllBlocksCleared"
    index = KVIndex()
    index.apply(batch)
    assert dict(index.copies) == cache_content(url)
    return index, batch.seq + 1


def test_events_tell_exactly_what_the_cache_holds() -> None:
    """Stored, evicted and cleared blocks, applied to an index, equal the cache's content
    (copies included) after every request; a 24-block cache under 30 prompts must evict."""
    with tapped(num_gpu_blocks=24) as (url, tap):
        index, seq = fresh_index(url, tap)
        kinds: set[str] = set()
        for i in range(30):
            # shared heads (hits), new tails (stores), a small cache (evictions)
            prompt = prompt_of(32, 5000) + prompt_of(16 + (i % 3) * 16, 20000 + 100 * i)
            complete(url, prompt, max_tokens=1 + i % 5)
            for batch in tap.drain():
                assert batch.seq == seq and batch.topic == b"kv-events" and batch.dp_rank == 0
                seq += 1
                index.apply(batch)
                kinds |= {e["type"] for e in batch.events}
            assert dict(index.copies) == cache_content(url)
        assert kinds == {"BlockStored", "BlockRemoved"}
        assert len(index.cached) == state(url)["num_cached_blocks"] > 0


def stored(batches: list[Any]) -> list[dict[str, Any]]:
    return [e for b in batches for e in b.events if e["type"] == "BlockStored"]


def test_stored_blocks_carry_their_own_tokens_and_chain() -> None:
    """token_ids are exactly the stored blocks' tokens: the sim's hashes recomputed from them
    (seeded by the parent) give the announced hashes; lora_id/lora_name/medium/group_idx as
    vLLM's.  One batch per engine step: the prefill's blocks, then each block decode fills."""
    with tapped() as (url, tap):
        _, seq = fresh_index(url, tap)
        prompt = prompt_of(50, 7000)
        complete(url, prompt, max_tokens=20)  # computed: 50 + 19 = 69 tokens -> 4 full blocks
        batches = tap.drain()
        assert [b.seq for b in batches] == [seq, seq + 1]
        prefill, decode = stored(batches)
        assert len(prefill["block_hashes"]) == 3 and len(decode["block_hashes"]) == 1
        assert prefill["parent_block_hash"] is None and decode["parent_block_hash"] == prefill["block_hashes"][-1]
        tokens = prefill["token_ids"] + decode["token_ids"]
        assert len(tokens) == 64 and tokens[:50] == prompt  # prompt, then the output tokens
        seed = block_seed(DEFAULT_MODEL, None, None)
        assert block_hashes(tokens, BLOCK, seed) == prefill["block_hashes"] + decode["block_hashes"]
        for event in (prefill, decode):
            assert event["block_size"] == BLOCK
            assert (event["lora_id"], event["lora_name"], event["medium"], event["group_idx"]) == (None, None, "GPU", 0)
            assert event["kv_cache_spec_kind"] == "full_attention"
            assert event["extra_keys"] == [None] * len(event["block_hashes"])
            assert list(event) == ["type", *FIELDS["BlockStored"][:10]]  # vLLM's order; defaults omitted

        # the next turn extends it: its first new block's parent is the last block already held
        complete(url, tokens + prompt_of(40, 9000), max_tokens=1)
        more = stored(tap.drain())
        assert more[0]["parent_block_hash"] == decode["block_hashes"][-1]
        assert block_hashes(more[0]["token_ids"], BLOCK, more[0]["parent_block_hash"]) == more[0]["block_hashes"]


def test_chunked_prefill_publishes_one_batch_per_chunk() -> None:
    """A prompt longer than max_num_batched_tokens is prefilled in chunks, one batch each (as
    recorded from vLLM: 2,743 tokens with a 2,048-token budget gave 16 blocks, then 5)."""
    with tapped(max_num_batched_tokens=64) as (url, tap):
        fresh_index(url, tap)
        complete(url, prompt_of(150, 13000))
        assert [len(e["block_hashes"]) for e in stored(tap.drain())] == [4, 4, 1]


def test_a_repeated_prompt_restores_its_last_full_block() -> None:
    """vLLM recomputes at least one token: a repeated prompt of whole blocks recomputes its last
    block and announces it again (a second copy); both copies are removed when evicted."""
    with tapped(num_gpu_blocks=8) as (url, tap):
        index, _ = fresh_index(url, tap)
        prompt = prompt_of(32, 11000)
        first = complete(url, prompt)
        again = complete(url, prompt)
        batches = tap.drain()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
        stored = [e for b in batches for e in b.events if e["type"] == "BlockStored"]
        assert len(stored) == 2
        assert stored[1]["block_hashes"] == stored[0]["block_hashes"][1:]
        assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][0]
        assert stored[1]["token_ids"] == prompt[16:]
        for b in batches:
            index.apply(b)
        last = stored[0]["block_hashes"][1]
        assert index.copies[last] == 2 == cache_content(url)[last]
        # fill the cache with other prompts: every copy goes, each with its own BlockRemoved
        for i in range(4):
            complete(url, prompt_of(32, 30000 + 100 * i))
        removed = [h for b in tap.drain() for e in b.events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert removed.count(last) == 2


def test_reset_and_restart() -> None:
    """POST /reset_prefix_cache: AllBlocksCleared, published (as vLLM does) with the batch of
    the next step, no hits after it; a restart starts the sequence at 0 again without any
    event (a dead process says nothing)."""
    with tapped() as (url, tap):
        prompt = prompt_of(40, 12000)
        complete(url, prompt)
        tap.drain()
        assert httpx.post(url + "/reset_prefix_cache").json() == {"success": True}
        assert tap.drain() == []  # an idle engine says nothing yet
        assert complete(url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        (batch,) = tap.drain()
        assert [e["type"] for e in batch.raw_events] == ["AllBlocksCleared", "BlockStored"]
        assert batch.raw_events[0] == {"type": "AllBlocksCleared"}
        # GET is not the method; the query parameter is accepted
        assert httpx.get(url + "/reset_prefix_cache").status_code == 405
        assert httpx.post(url + "/reset_prefix_cache?reset_running_requests=true").json() == {"success": True}

        httpx.post(url + "/sim/restart", json={}).raise_for_status()
        complete(url, prompt)
        (after,) = tap.drain()
        assert after.seq == 0
        assert [e["type"] for e in after.events] == ["BlockStored"]
        assert cache_content(url) == dict.fromkeys((int_hash(h) for h in after.events[0]["block_hashes"]), 1)


def test_reset_fails_while_requests_hold_blocks() -> None:
    """Like vLLM: {"success": false} while running requests hold blocks, unless they are reset too."""
    replica = Replica(build_options(block_size=BLOCK, time_scale=1.0))
    engine = replica.engine
    got: list[EventBatch] = []
    engine.kv_events.subscribe(got.append)
    seed = replica.block_seed(None, None)
    (req,) = replica.engine_requests(prompt_of(40, 100), 8, "length", 1, seed, 0.0)
    engine.waiting.append(req)
    scheduled, _ = engine._schedule()
    engine._apply(scheduled)
    assert engine.num_running == 1
    assert engine.reset_prefix_cache() is False
    assert engine.reset_prefix_cache(reset_running_requests=True) is True
    assert engine.num_running == 0 and engine.num_waiting == 1  # preempted: it recomputes
    assert engine.kv_events.pending == [{"type": "AllBlocksCleared"}]  # out with the next step
    scheduled, _ = engine._schedule()
    engine._apply(scheduled)
    assert got[-1].events[0] == {"type": "AllBlocksCleared"}
    assert got[-1].events[1]["type"] == "BlockStored"  # recomputed from scratch


def test_replay_serves_the_buffer_then_the_end_frame() -> None:
    """The ROUTER answers [b"", start_seq] with [b"", topic, seq, payload] per buffered batch from
    start_seq on (the last buffer_steps of them), then [b"", b"", 0xFF*8, b""]; the replayed frames
    are the published ones, byte for byte."""
    with tapped(events={"buffer_steps": 3}) as (url, tap):
        for i in range(5):
            complete(url, prompt_of(20, 40000 + 100 * i))
        live = tap.drain()
        assert len(live) == 5
        last = live[-1].seq
        got, end = tap.replay(0)
        assert end == [b"", b"", END_SEQ, b""]
        assert [int.from_bytes(f[2], "big") for f in got] == [last - 2, last - 1, last]  # buffer_steps=3
        assert all(f[0] == b"" and f[1] == b"kv-events" for f in got)
        assert [f[3] for f in got] == [b.payload for b in live[-3:]]
        got, _ = tap.replay(last)
        assert [int.from_bytes(f[2], "big") for f in got] == [last]
        got, end = tap.replay(last + 100)  # nothing that new: just the end
        assert got == [] and end[2] == END_SEQ
        # a malformed request is ignored (vLLM logs it); the socket keeps serving
        dealer = tap.ctx.socket(zmq.DEALER)
        dealer.connect(tap.replay_endpoint)
        dealer.send_multipart([b"", b"x", b"y"])
        dealer.close(linger=0)
        got, end = tap.replay(last)
        assert len(got) == 1 and end[2] == END_SEQ


@pytest.mark.parametrize("layout", ["map", "array"])
@pytest.mark.parametrize("int_hashes", [True, False])
def test_layouts_and_hash_types(layout: str, int_hashes: bool) -> None:
    """Tagged maps (0.32) or positional arrays (older vLLM); unsigned 64-bit hashes (default) or
    32 raw digest bytes whose low 64 bits are the integer form: the same blocks either way."""
    with tapped(kv_events_layout=layout, kv_events_int_hashes=int_hashes, num_gpu_blocks=6) as (url, tap):
        fresh_index(url, tap)
        prompt = prompt_of(40, 50000)
        complete(url, prompt, max_tokens=9)  # 48 computed -> 3 full blocks
        for i in range(3):  # evict them
            complete(url, prompt_of(40, 60000 + 100 * i), max_tokens=9)
        batches = tap.drain()
        raw = batches[0].raw_events[0]
        first = batches[0].events[0]
        if layout == "map":
            assert isinstance(raw, dict) and raw["type"] == "BlockStored"
        else:
            assert isinstance(raw, list) and raw[0] == "BlockStored" and len(raw) == 11
        hashes = [h for e in stored(batches[:2]) for h in e["block_hashes"]]
        if int_hashes:
            assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
        else:
            assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
        seed = block_seed(DEFAULT_MODEL, None, None)
        tokens = [t for e in stored(batches[:2]) for t in e["token_ids"]]
        assert tokens[:40] == prompt and first["parent_block_hash"] is None
        assert [int_hash(h) for h in hashes] == block_hashes(tokens, BLOCK, seed)
        removed = [normalize(e) for b in batches for e in b.raw_events]
        removed = [e for e in removed if e["type"] == "BlockRemoved"]
        assert removed and all(len(e["block_hashes"]) == 1 and e["medium"] == "GPU" for e in removed)
        assert {int_hash(e["block_hashes"][0]) for e in removed} >= {int_hash(h) for h in hashes}


def test_lora_and_cache_salt_label_the_blocks() -> None:
    """A LoRA's blocks carry lora_id / lora_name and its name in every block's extra_keys; the
    first block also carries cache_salt (vLLM's untagged per-block extra keys)."""
    with tapped(lora_modules=["sql-adapter", "chat-adapter"]) as (url, tap):
        fresh_index(url, tap)
        complete(url, prompt_of(40, 70000), model="chat-adapter", cache_salt="tenant-1")
        complete(url, prompt_of(40, 70000), cache_salt="tenant-1")
        first, second = (b.events[0] for b in tap.drain())
        assert (first["lora_id"], first["lora_name"]) == (2, "chat-adapter")
        assert first["extra_keys"] == [["chat-adapter", "tenant-1"], ["chat-adapter"]]
        assert (second["lora_id"], second["lora_name"]) == (None, None)
        assert second["extra_keys"] == [["tenant-1"], None]
        assert first["block_hashes"] != second["block_hashes"]  # isolated caches


def test_publisher_connects_to_a_collector() -> None:
    """A plain tcp://host:port endpoint makes the sim connect to a collector that binds (vLLM's rule)."""
    ctx = zmq.Context()
    collector = ctx.socket(zmq.SUB)
    collector.setsockopt(zmq.SUBSCRIBE, b"")
    port = collector.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}", "topic": "t"}
        with serve_in_thread({**FAST, "kv_events_config": config}) as url:
            source = httpx.get(url + "/kv_event_sources").json()["0"]
            assert source["endpoint"] == f"tcp://127.0.0.1:{port}" and source["replay_endpoint"] is None
            start = iter(range(80000, 10**6, 100))

            def arrived() -> list[bytes] | None:
                complete(url, prompt_of(20, next(start)))
                return collector.recv_multipart() if collector.poll(100) else None

            topic, seq, payload = poll(arrived)
            assert topic == b"t" and len(seq) == 8
            assert decode(topic, seq, payload).events[0]["type"] == "BlockStored"
    finally:
        ctx.destroy(linger=0)


def test_no_events_without_the_config() -> None:
    """Off by default, as in vLLM: /kv_event_sources is {} and no socket is opened."""
    with serve_in_thread(FAST) as url:
        assert httpx.get(url + "/kv_event_sources").json() == {}
        complete(url, prompt_of(20, 1))
    disabled = parse_kv_events_config(json.dumps({"enable_kv_cache_events": False}))
    assert disabled is not None and not disabled.publishes and disabled.resolved_publisher == "null"
    with pytest.raises(ValueError, match="kv_events_config"):
        build_options(kv_events_config='{"endpoint": "http://nope"}')
    with pytest.raises(ValueError, match="kv_events_config"):
        build_options(kv_events_config="{not json")
    assert KVEventsConfig().endpoint == "tcp://*:5557" and KVEventsConfig().buffer_steps == 10_000


def test_in_process_callback_gets_the_wire_batches() -> None:
    """Without sockets (the virtual-clock benchmark drives the engine itself): a callback gets
    each step's batch, numbered like the wire, and its payload() is the wire's third frame."""
    replica = Replica(build_options(block_size=BLOCK, num_gpu_blocks=10, time_scale=1.0))
    engine = replica.engine
    got: list[EventBatch] = []
    unsubscribe = engine.kv_events.subscribe(got.append)
    seed = replica.block_seed(None, None)
    index = KVIndex()

    def run(prompt: list[int], out: int) -> EngineRequest:
        (req,) = replica.engine_requests(prompt, out, "length", 1, seed, 0.0)
        engine.waiting.append(req)
        while not req.finished:
            scheduled, _ = engine._schedule()
            engine._apply(scheduled)
        return req

    for i in range(6):
        run(prompt_of(40, 1000 * i), 9)
    assert [b.seq for b in got] == list(range(len(got)))
    for b in got:
        assert msgpack.unpackb(b.payload(), raw=False) == [b.ts, b.events, 0]
        index.apply(decode(b"", b.seq.to_bytes(8, "big"), b.payload()))
    assert dict(index.copies) == engine.cache.copies()
    assert any(e["type"] == "BlockRemoved" for b in got for e in b.events)
    unsubscribe()
    assert not engine.kv_events.active
    before = len(got)
    run(prompt_of(40, 99000), 9)
    assert len(got) == before


def test_digest_bytes_keep_the_integer_form() -> None:
    for key in (0, 1, 2**63 + 12345, 2**64 - 1):
        digest = digest_bytes(key)
        assert len(digest) == 32 and int_hash(digest) == key


def test_launcher_turns_events_on_with_free_ports(tmp_path) -> None:
    """ReplicaGroup(kv_events=True): each replica publishes on ports of its own, kept across a
    restart; the group says where to connect."""
    group = ReplicaGroup(2, kv_events=True, log_dir=tmp_path, **FAST, enable_admin=True)
    with group:
        endpoints = [(r.kv_events_endpoint, r.kv_replay_endpoint) for r in group.replicas]
        assert len({e for pair in endpoints for e in pair}) == 4
        assert all(e is not None and e.startswith("tcp://127.0.0.1:") for pair in endpoints for e in pair)
        for replica in group.replicas:
            source = httpx.get(replica.url + "/kv_event_sources").json()["0"]
            assert source["endpoint"] == replica.kv_events_endpoint.replace("127.0.0.1", "*")
            tap = KVTap(replica.url)
            try:
                tap.sync()
            finally:
                tap.close()
        group.kill(1)
        group.restart(1)
        assert (group.replicas[1].kv_events_endpoint, group.replicas[1].kv_replay_endpoint) == endpoints[1]
        tap = KVTap(group.replicas[1].url)
        try:
            assert tap.sync().seq < 50  # a new process: its sequence started again from 0
        finally:
            tap.close()


def test_stepping_engine_publishes_its_steps() -> None:
    """With simulated time (time_scale > 0) the engine loop publishes too: chunked prefill and
    decode fills as their own batches, and the cache content still matches the events."""
    with tapped(time_scale=0.01, max_num_batched_tokens=32, num_gpu_blocks=40) as (url, tap):
        index, seq = fresh_index(url, tap)
        for i in range(3):
            complete(url, prompt_of(70, 90000 + 1000 * i), max_tokens=20)
        batches = tap.drain()
        assert [b.seq for b in batches] == list(range(seq, seq + len(batches)))
        for b in batches:
            index.apply(b)
        assert dict(index.copies) == cache_content(url)
        # 70 prompt tokens in 32-token chunks: 2 blocks, 2 blocks, then decode fills the 5th
        assert [len(e["block_hashes"]) for e in stored(batches)][:3] == [2, 2, 1]


def test_shared_fleet_helper_turns_events_on(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.replica_fleet import fresh, kv_event_endpoints, shared_group

    with shared_group(tmp_path_factory, "kv-fleet", 1, kv_events=True, **FAST, enable_admin=True) as group:
        ((endpoint, replay),) = kv_event_endpoints(group)
        assert endpoint.startswith("tcp://127.0.0.1:") and replay is not None
        tap = KVTap(fresh(group).urls[0])
        try:
            before = max(tap.sync().seq for _ in range(12))
            assert before >= 11
            fresh(group)  # a restart: the sequence starts over (the SUB reconnects by itself)
            assert tap.sync().seq < before
        finally:
            tap.close()


def test_cli_hash_type_follows_vllms_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.sim.cli import build_parser

    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    assert build_parser().parse_args([]).kv_events_int_hashes is True
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert build_parser().parse_args([]).kv_events_int_hashes is False
    assert build_parser().parse_args(["--kv-events-int-hashes"]).kv_events_int_hashes is True
