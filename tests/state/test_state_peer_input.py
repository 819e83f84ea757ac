"""What a peer's message may cost this process, and what a failed publish may lose.

A record holds at most what one ``max_body_bytes`` prompt can produce (larger ones are refused
and counted), a large message is applied in chunks that let the event loop run, and a
publish that fails is counted, never silently lost, without losing a catch-up's end.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.config import NormalizeSettings, PrefixSettings
from gateway.prefix.pipeline import PrefixPipeline
from gateway.routing.affinity import AffinityIndex
from gateway.state.affinity_sync import APPLY_CHUNK_KEYS, AffinitySync
from gateway.state.record_bounds import max_chain_keys, max_record_keys, relocated_bytes
from gateway.state.wire import MAX_KEYS_PER_RECORD, Record, encode
from tests.polling import until
from tests.state.test_state_catchup import NAMES, chains, index, process

BODY = 64 << 10  # a small max_body_bytes, so the derived cap is below the wire's own


def _hostile_bodies(budget: int) -> list[tuple[str, bytes]]:
    """Request bodies (as sent) of at most ``budget`` bytes shaped to make as many keys as they can."""
    n = (budget - 64) // 3
    return [
        ("empty messages", b'{"model":"m","messages":[' + b",".join([b"{}"] * n) + b"]}"),
        ("empty content parts", b'{"model":"m","messages":[{"content":[' + b",".join([b"{}"] * (n - 10)) + b"]}]}"),
        ("long floats", b'{"model":"m","messages":[{}],"tools":[' + b",".join([b"9e15"] * (n * 3 // 5)) + b"]}"),
        ("one long text", b'{"model":"m","messages":[{"content":"' + b"ab " * n + b'"}]}'),
    ]


def test_no_prompt_within_max_body_bytes_makes_more_keys_than_the_bound() -> None:
    settings = PrefixSettings(tokenizer="cl100k_base", window_tokens=256, block_size=16, chunk_bytes=16)
    pipeline = PrefixPipeline(NormalizeSettings(mode="off"), settings)
    idx = AffinityIndex(10, stride=4)
    bound = max_chain_keys(BODY, settings.window_tokens, settings.block_size, settings.chunk_bytes)
    cap = max_record_keys(BODY, settings.window_tokens, settings.block_size, settings.chunk_bytes, idx.stride)
    assert cap < MAX_KEYS_PER_RECORD
    made = {}
    for what, raw in _hostile_bodies(BODY):
        assert len(raw) <= BODY, what
        keys = pipeline.prepare("chat", json.loads(raw), learn=False).keys
        made[what] = len(keys)
        assert len(keys) <= bound and len(idx.stored_keys(keys)) <= cap, what
    ids = {"model": "m", "prompt": [1] * ((BODY - 40) // 2)}
    assert len(idx.stored_keys(pipeline.prepare("completions", ids, learn=False).keys)) <= cap
    # relocation adds text: every digit of the scanned system prompt moved under a 32-character rule name
    normalize = NormalizeSettings(mode="relocate", rules=[{"name": "r" * 32, "pattern": r"\d"}])
    relocating = PrefixPipeline(normalize, settings)
    raw = b'{"model":"m","messages":[{"role":"system","content":"' + b"1 " * ((BODY - 80) // 2) + b'"}]}'
    prepared = relocating.prepare("chat", json.loads(raw))
    assert len(raw) <= BODY and prepared.spans_moved > 500
    added = relocated_bytes("relocate", max(normalize.max_scan_chars, normalize.completion_prefix_chars))
    assert len(json.dumps(prepared.body).encode()) - len(raw) <= added
    assert len(prepared.keys) <= max_chain_keys(BODY, 256, 16, 16, added)
    # the message term is real: a body of empty messages makes a key per message
    assert made["empty messages"] > BODY // 4


async def test_an_oversize_record_is_refused_and_counted(redis_url: str) -> None:
    channel = f"test-oversize-{uuid.uuid4().hex}"
    idx = index()
    cap = max_record_keys(BODY, 4096, 16, 1024, idx.stride)
    sync = AffinitySync(redis_url, channel, {"chat": idx}, batch_interval_s=0.001)
    sync.key_caps = {"chat": cap}
    at_cap, over = list(range(1, cap + 1)), list(range(10**6, 10**6 + cap + 1))  # stored keys, deepest first
    payload = encode("attacker", [Record("chat", "r0", at_cap, None), Record("chat", "r1", over, None)])
    await sync.start()
    publisher = aioredis.from_url(redis_url)
    try:
        await until(lambda: sync.stats.connected, what="subscribed")
        await publisher.publish(channel, payload)
        await until(lambda: sync.stats.applied + sync.stats.oversize == 2, what="the message applied")
        assert (sync.stats.applied, sync.stats.oversize) == (1, 1)
        assert set(idx.match(at_cap[::-1], NAMES)) == {"r0"} and idx.match(over[::-1], NAMES) == {}
        # and this process keeps its own oversize records local rather than send what peers refuse
        idx.record("r2", list(range(2 * 10**6, 2 * 10**6 + 4 * cap + 8)))
        assert sync.stats.dropped == 1
    finally:
        await publisher.aclose()
        await sync.stop()


async def test_a_large_message_is_applied_in_chunks_that_let_other_tasks_run(redis_url: str) -> None:
    channel = f"test-chunks-{uuid.uuid4().hex}"
    idx = AffinityIndex(1_000_000, stride=1)
    idx.set_members(NAMES)
    sync = AffinitySync(redis_url, channel, {"chat": idx}, batch_interval_s=0.001)
    records = [
        Record("chat", NAMES[i % len(NAMES)], list(range(i * 10**6 + 1, i * 10**6 + 2001)), None) for i in range(100)
    ]
    payload = encode("big-peer", records)  # 200,000 keys, ~2.7 MB
    seen: set[int] = set()

    async def watch() -> None:  # another task: what does it see of the message between its turns?
        while True:
            seen.add(sync.stats.applied)
            await asyncio.sleep(0)

    await sync.start()
    watcher = asyncio.get_running_loop().create_task(watch())
    publisher = aioredis.from_url(redis_url)
    try:
        await until(lambda: sync.stats.connected, what="subscribed")
        await publisher.publish(channel, payload)
        await until(lambda: sync.stats.applied == 100, what="the message applied")
        partial = {n for n in seen if 0 < n < 100}
        # it ran between the chunks: it saw the message part applied, once a chunk
        records_per_turn = -(-APPLY_CHUNK_KEYS // 2000)
        assert len(partial) >= 100 // records_per_turn - 1
    finally:
        watcher.cancel()
        await publisher.aclose()
        await sync.stop()


async def test_one_large_record_is_applied_in_chunks_too(redis_url: str) -> None:
    channel = f"test-chunks-{uuid.uuid4().hex}"
    idx = AffinityIndex(1_000_000, stride=1)
    idx.set_members(NAMES)
    sync = AffinitySync(redis_url, channel, {"chat": idx}, batch_interval_s=0.001)
    keys = list(range(1, 60_001))  # under the wire's 65,536: one record, ~0.1 s to apply at once
    seen: set[int] = set()

    async def watch() -> None:
        while True:
            seen.add(len(idx._lru.get("r1", ())))
            await asyncio.sleep(0)

    await sync.start()
    watcher = asyncio.get_running_loop().create_task(watch())
    publisher = aioredis.from_url(redis_url)
    try:
        await until(lambda: sync.stats.connected, what="subscribed")
        await publisher.publish(channel, encode("big-peer", [Record("chat", "r1", keys, 70_000)]))
        await until(lambda: sync.stats.applied == 1, what="the record applied")
        assert len({n for n in seen if 0 < n < len(keys)}) >= len(keys) // APPLY_CHUNK_KEYS - 1
        # and it is the record as applied at once: deepest key marked with the prompt's length
        assert idx._lru["r1"][keys[0]] == 70_000 and set(idx.match(keys[::-1], NAMES)) == {"r1"}
    finally:
        watcher.cancel()
        await publisher.aclose()
        await sync.stop()


async def test_a_failed_publish_is_counted_and_the_newcomer_still_becomes_ready(redis_url: str) -> None:
    channel = f"test-lost-{uuid.uuid4().hex}"
    old_index, new_index = index(), index()
    old, _ = process(redis_url, channel, old_index)
    await old.start()
    try:
        for i, keys in enumerate(chains(10, 5)):
            old_index.record(NAMES[i % 3], keys, prompt_tokens=500)
        await until(lambda: old.stats.published == 10, what="records published")
        real, failed = old._redis.publish, []

        async def flaky(name: str, data: bytes) -> Any:  # the snapshot's publish fails (a timeout, a failover)
            if name == channel and not failed:
                failed.append(data)
                raise ConnectionError("injected: publish failed")
            return await real(name, data)

        old._redis.publish = flaky
        new, new_catch_up = process(redis_url, channel, new_index)
        await new.start()
        new_catch_up.start(time.monotonic())
        try:
            await until(lambda: failed and old.stats.dropped == 10, what="the snapshot's records counted as lost")
            await until(lambda: new_catch_up.readiness(time.monotonic())[0], what="the newcomer ready")
            assert new_catch_up.readiness(time.monotonic()) == (True, "snapshot received")
            assert old.stats.errors >= 1 and new.stats.snapshots_heard == 1
        finally:
            await new.stop()
    finally:
        await old.stop()


@pytest.mark.parametrize("stride", [1, 4])
def test_the_default_body_limit_leaves_the_wire_cap(stride: int) -> None:
    """10 MiB of empty messages would make millions of keys: the wire's own cap applies."""
    assert max_record_keys(10 << 20, 4096, 16, 1024, stride) == MAX_KEYS_PER_RECORD


async def test_what_a_failed_publish_held_is_counted_and_a_snapshot_end_waits_for_the_next() -> None:
    idx = index()
    sync = AffinitySync("redis://127.0.0.1:1/0", "unused", {"chat": idx}, batch_interval_s=0.001)
    idx.record("r0", chains(1, 7)[0])
    sync._enqueue_start("chat", 42)
    sync._enqueue_varies("chat", 7, 9)
    sync.offer([])  # a catch-up's end mark (nothing learned to send with it)
    await sync.start()
    try:
        await until(lambda: sync.stats.dropped_sightings == 2, what="the lost start and place counted")
        assert sync.stats.dropped == 1  # the record; the end mark is not one
        assert list(sync._pending) == [None]  # ... and waits to go out once Redis takes it
    finally:
        await sync.stop()
