"""The decoder and the index on KV events recorded from a real vLLM 0.32 (tests/fixtures/real_vllm/,
written by the real-engine lane): every message decodes, the keys recomputed from the
recorded ``token_ids`` equal the gateway's own keys for the recorded requests, removals and
the reset apply, the replay socket's answer and the raw-digest run decode too."""

from __future__ import annotations

import base64
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from gateway.kv_events.decoder import AllBlocksCleared, Batch, BlockRemoved, BlockStored, decode_frames, decode_payload
from gateway.kv_events.index import PreciseIndex
from gateway.kv_events.ingest import Ingestor
from gateway.prefix.blocks import chain_block_keys, engine_seed
from gateway.prefix.pipeline import PrefixPipeline
from gateway.prefix.settings import NormalizeSettings, PrefixSettings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real_vllm"
pytestmark = pytest.mark.skipif(not (FIXTURES / "kv_events.jsonl").exists(), reason="no recorded fixtures")


def _lines(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


@cache
def _recording() -> dict[str, Any]:
    return json.loads((FIXTURES / "recording.json").read_text())


def _base_model() -> str:
    models = json.loads((FIXTURES / "models.json").read_text())["data"]
    return next(m["id"] for m in models if not m.get("parent"))


def _batches(name: str) -> list[tuple[dict[str, Any], Batch]]:
    return [
        (row, decode_payload(row["topic"].encode(), row["seq"], base64.b64decode(row["payload_b64"])))
        for row in _lines(name)
    ]


def _ingestor() -> Ingestor:
    index = PreciseIndex(1 << 30, max_depth_tokens=1 << 20)
    index.add("real", _base_model())
    return Ingestor(index)


def _gateway_keys() -> dict[str, tuple[int, ...]]:
    """Each recorded request's block keys as the gateway's route computes them (block size = the engine's)."""
    pipeline = PrefixPipeline(
        NormalizeSettings(), PrefixSettings(block_size=_recording()["block_size"], window_tokens=8192)
    )
    keys = {}
    for row in _lines("requests.jsonl"):
        if row.get("prompt_token_ids") and row["status"] == 200:
            endpoint = "chat" if row["endpoint"].endswith("chat/completions") else "completions"
            prepared = pipeline.prepare(endpoint, row["request"], learn=False)
            if list(pipeline.window_tokens(endpoint, row["request"])) == row["prompt_token_ids"]:
                keys[row["id"]] = prepared.block_keys  # tokens aligned (special-token text is align's work)
    return keys


def test_every_recorded_message_decodes_in_sequence_and_applies_cleanly() -> None:
    batches = _batches("kv_events.jsonl")
    ingestor = _ingestor()
    kinds: set[str] = set()
    for _, batch in batches:
        assert batch.skipped == {}
        kinds.update(type(event).__name__ for event in batch.events)
        before = set(ingestor.index._replicas["real"].refs)
        events = batch.events
        clear = next((i for i, event in enumerate(events) if isinstance(event, AllBlocksCleared)), None)
        if clear is None:
            assert ingestor.ingest("real", batch.dp_rank, batch.seq, events) in ("first", "next")
        else:  # the reset's clear comes first in the next step's batch, then that step's stores
            assert ingestor.ingest("real", batch.dp_rank, batch.seq, events[: clear + 1]) in ("first", "next")
            assert before and not any(ingestor.index.holds("real", key) for key in before)
            ingestor.index.apply("real", events[clear + 1 :])
        # the engine's cache holds at most num_gpu_blocks: so does what the index learned of it
        assert ingestor.index.blocks("real") <= _recording()["num_gpu_blocks_override"]
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    feed = ingestor.feeds["real"]
    assert feed.gaps == feed.restarts == 0 and feed.messages == len(batches)
    skipped = {reason: n for reason, n in ingestor.index.skipped.items() if n}
    assert skipped == {}  # every parent known, every removal of a block it indexed


def test_keys_recomputed_from_recorded_token_ids_equal_the_gateways_keys_for_the_prompts() -> None:
    gateway_keys = _gateway_keys()
    assert len(gateway_keys) >= 20
    ingestor = _ingestor()
    compared = 0
    for row, batch in _batches("kv_events.jsonl"):
        ingestor.ingest("real", batch.dp_rank, batch.seq, batch.events)
        keys = gateway_keys.get(row.get("after"))
        engine = ingestor.index._replicas["real"].engine
        for event in batch.events:
            if not isinstance(event, BlockStored) or keys is None:
                continue
            for block in event.block_hashes:
                ours, depth, _ = engine[block]
                if depth <= len(keys):  # deeper: blocks of generated tokens
                    assert ours == keys[depth - 1], (row["after"], depth)
                    compared += 1
    assert compared >= 300


def test_the_index_matches_a_conversations_next_turn_as_far_as_the_engine_reports() -> None:
    """After the events of turn 0, turn 1's gateway keys match every block turn 0 stored."""
    gateway_keys = _gateway_keys()
    ingestor = _ingestor()
    for row, batch in _batches("kv_events.jsonl"):
        ingestor.ingest("real", batch.dp_rank, batch.seq, batch.events)
        if row.get("after") == "support-0-t0":
            break
    depth = ingestor.index.leading(gateway_keys["support-0-t1"]).get("real", 0)
    assert depth == len(gateway_keys["support-0-t0"])


def test_raw_digest_hashes_decode_and_index_the_same_way() -> None:
    ingestor = _ingestor()
    stored = 0
    for _, batch in _batches("kv_events_bytes_hashes.jsonl"):
        for event in batch.events:
            if isinstance(event, BlockStored | BlockRemoved):
                assert all(isinstance(h, bytes) and len(h) == 32 for h in event.block_hashes)
                stored += isinstance(event, BlockStored)
        ingestor.ingest("real", batch.dp_rank, batch.seq, batch.events)
    assert stored and ingestor.index.blocks("real") > 0
    assert {reason: n for reason, n in ingestor.index.skipped.items() if n} == {}


def test_the_recorded_replay_answer_decodes_to_the_live_messages() -> None:
    live = {batch.seq: base64.b64decode(row["payload_b64"]) for row, batch in _batches("kv_events.jsonl")}
    replies = [[base64.b64decode(f) for f in row["frames_b64"]] for row in _lines("kv_replay.jsonl")]
    assert replies[-1][2] == b"\xff" * 8  # the end marker
    start = _recording()["replay_start_seq"]
    seqs = []
    for frames in replies[:-1]:
        assert frames[0] == b""
        batch = decode_frames(frames[1:])
        assert frames[3] == live[batch.seq]
        seqs.append(batch.seq)
    assert seqs == sorted(seqs) and seqs[0] == start


def test_lora_requests_events_key_like_the_contracts_engine_seed() -> None:
    """A LoRA adapter's events (``lora_name``, the name in every block's extra keys) recompute to
    ``engine_seed(base model, adapter, salt)``-seeded keys over the request's prompt ids."""
    models = json.loads((FIXTURES / "models.json").read_text())["data"]
    base = _base_model()
    adapters = {m["id"] for m in models if m.get("parent") == base}
    expected: dict[str, list[int]] = {}
    for row in _lines("requests.jsonl"):
        request = row.get("request") or {}
        model = request.get("model")
        if row.get("prompt_token_ids") and row["status"] == 200 and model in adapters:
            seed = engine_seed(base, model, request.get("cache_salt"))
            expected[row["id"]] = chain_block_keys(row["prompt_token_ids"], _recording()["block_size"], seed)
    if not adapters:
        pytest.skip("recorded without a LoRA adapter")
    assert expected
    ingestor = _ingestor()
    compared = 0
    for row, batch in _batches("kv_events.jsonl"):
        ingestor.ingest("real", batch.dp_rank, batch.seq, batch.events)
        keys = expected.get(row.get("after"))
        engine = ingestor.index._replicas["real"].engine
        for event in batch.events:
            if keys is None or not isinstance(event, BlockStored):
                continue
            assert event.lora_name in adapters
            for block in event.block_hashes:
                ours, depth, _ = engine[block]
                if depth <= len(keys):
                    assert ours == keys[depth - 1]
                    compared += 1
    assert compared > 0
