"""The simulator against a recorded real vLLM 0.32 (tests/fixtures/real_vllm/, written by the
real-engine lane): the same requests, replayed in order into a sim configured like the recorded
engine, must give the same statuses, error bodies, usage (values included: same tokenizer,
same block size, same cache size, same eviction order), response shapes, and KV event
batches, field by field.  Runs everywhere: no vLLM needed, only its recording.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from kv_tap import END_SEQ, KVTap

from gateway.sim.app import create_app
from gateway.sim.kvevents import EventBatch
from gateway.sim.server import serve_in_thread

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real_vllm"


def _jsonl(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


RECORDING = json.loads((FIXTURES / "recording.json").read_text())
MODELS = json.loads((FIXTURES / "models.json").read_text())
COMMAND = RECORDING["command"]
TOPIC = json.loads(COMMAND[COMMAND.index("--kv-events-config") + 1])["topic"]


def recorded_options() -> dict[str, Any]:
    """The sim configured as the recorded engine: its block size and cache size (from its own
    cache_config_info), max_model_len, served name and LoRA adapters, CPU's 2,048-token
    prefill budget."""
    info = next(line for line in (FIXTURES / "metrics.txt").read_text().splitlines() if line.startswith("vllm:cache"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info))
    assert int(labels["block_size"]) == RECORDING["block_size"]
    return {
        "time_scale": 0,
        "log_stats_interval": 0,
        "model": RECORDING["served_model_name"],
        "block_size": int(labels["block_size"]),
        "num_gpu_blocks": int(labels["num_gpu_blocks"]),
        "max_model_len": MODELS["data"][0]["max_model_len"],
        "max_num_batched_tokens": 2048,  # vLLM's CPU default (the recorded 2,743-token prefill: 16 blocks, then 5)
        "device": "cpu",
        "enable_admin": True,
        # the recorded LoRA adapters: /v1/models entries whose parent is the base model
        "lora_modules": [m["id"] for m in MODELS["data"] if m["parent"] == RECORDING["served_model_name"]],
    }


def _payload_events(payload_b64: str) -> list[Any]:
    ts, events, rank = msgpack.unpackb(base64.b64decode(payload_b64), raw=False)
    assert isinstance(ts, float) and rank == 0
    return events


def recorded_batches(name: str) -> dict[str | None, list[list[Any]]]:
    out: dict[str | None, list[list[Any]]] = {}
    for line in _jsonl(name):
        out.setdefault(line.get("after"), []).append(_payload_events(line["payload_b64"]))
    return out


def replay(requests: list[dict[str, Any]], **options: Any) -> dict[str, tuple[int, Any, list[list[Any]]]]:
    """Send ``requests`` in order to an in-process sim; per id: (status, body or SSE data lines,
    the event batches the request caused, taken from the sim's in-process event hook)."""
    app = create_app({**recorded_options(), **options})
    batches: list[EventBatch] = []
    app.replica.engine.kv_events.subscribe(batches.append)
    out: dict[str, tuple[int, Any, list[list[Any]]]] = {}

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim", timeout=60) as http:
            for r in requests:
                start = len(batches)
                resp = await http.post(r["endpoint"], json=r["request"])
                if r.get("sse"):
                    body: Any = [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]
                else:
                    body = resp.json()
                out[r["id"]] = (resp.status_code, body, [b.events for b in batches[start:]])

    try:
        asyncio.run(run())
    finally:
        app.close()
    return out


@pytest.fixture(scope="module")
def int_run() -> tuple[list[dict[str, Any]], dict[str, tuple[int, Any, list[list[Any]]]]]:
    requests = _jsonl("requests.jsonl")
    return requests, replay(requests)


def shape(value: Any) -> Any:
    """Field names and value types, recursively (the content of strings is the model's own)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def test_statuses_and_error_bodies_are_the_recorded_ones(int_run) -> None:
    requests, got = int_run
    errors = 0
    for r in requests:
        status, body, _ = got[r["id"]]
        assert status == r["status"], (r["id"], body)
        if status != 200:
            errors += 1
            assert body == r["response"], r["id"]  # message, type, param and code, exactly
    assert errors >= 5  # temperature, max_tokens (both endpoints), validation, unknown model, ...


def test_usage_is_the_recorded_usage(int_run) -> None:
    """Every usage object equals the recorded one: prompt_tokens (same tokenizer and template),
    cached_tokens and created_cache_tokens (same blocks, same evictions), nulls and omissions
    (a stream's usage chunk leaves nulls out; completions report created_cache_tokens null)."""
    requests, got = int_run
    compared = 0
    for r in requests:
        status, body, _ = got[r["id"]]
        if status != 200 or r["endpoint"] not in ("/v1/chat/completions", "/v1/completions"):
            continue
        if r["sse"]:
            want, have = json.loads(r["sse"][-2])["usage"], json.loads(body[-2])["usage"]
            assert body[-1] == "[DONE]"
        else:
            want, have = r["response"]["usage"], body["usage"]
        assert have == want, r["id"]
        compared += 1
    assert compared >= 20


def test_responses_have_the_recorded_fields(int_run) -> None:
    """Bodies and stream chunks: the same field names, in the same order, with the same types."""
    requests, got = int_run
    for r in requests:
        status, body, _ = got[r["id"]]
        if status != 200 or r["endpoint"] not in ("/v1/chat/completions", "/v1/completions"):
            continue
        if r["sse"]:
            want = {json.dumps(shape(json.loads(d))) for d in r["sse"][:-1]}
            have = {json.dumps(shape(json.loads(d))) for d in body[:-1]}
            assert have == want, r["id"]
        else:
            assert json.dumps(shape(body)) == json.dumps(shape(r["response"])), r["id"]


def _summary(batches: list[list[Any]]) -> list[list[tuple[str, int]]]:
    return [[(e["type"], len(e.get("block_hashes", []))) for e in batch] for batch in batches]


def test_event_batches_are_the_recorded_ones(int_run) -> None:
    """Per request: the same batches (one per engine step: chunked prefill, decode fills,
    evictions), the same events in each, the same number of blocks per event."""
    requests, got = int_run
    recorded = recorded_batches("kv_events.jsonl")
    kinds: set[str] = set()
    for r in requests:
        _, _, batches = got[r["id"]]
        assert _summary(batches) == _summary(recorded.get(r["id"], [])), r["id"]
        kinds |= {e["type"] for batch in batches for e in batch}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def test_events_have_the_recorded_fields_and_prompt_tokens(int_run) -> None:
    """Each event type: the same field names in the same order, the same value types, the same
    omissions; hashes unsigned 64-bit; and the stored token_ids of prompt blocks are the
    engine's own (the sim's hashes differ by design: consumers recompute from token_ids)."""
    requests, got = int_run
    recorded = recorded_batches("kv_events.jsonl")
    by_id = {r["id"]: r for r in requests}

    def fields(batches: list[list[Any]]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for batch in batches:
            for e in batch:
                typed = {k: type(v).__name__ for k, v in e.items() if k not in ("parent_block_hash", "extra_keys")}
                out.setdefault(e["type"], set()).add(json.dumps(list(typed.items())))
        return out

    sim_batches = [b for _, _, bs in got.values() for b in bs]
    real_batches = [b for bs in recorded.values() for b in bs]
    assert fields(sim_batches) == fields(real_batches)
    for batch in sim_batches:
        for e in batch:
            assert all(isinstance(h, int) and 0 <= h < 2**64 for h in e.get("block_hashes", []))
            if e["type"] == "BlockStored":
                assert len(e["extra_keys"]) == len(e["block_hashes"])
                assert len(e["token_ids"]) == len(e["block_hashes"]) * e["block_size"]
    compared = 0
    for rid, (_, _, batches) in got.items():
        prompt = by_id[rid].get("prompt_token_ids") or []
        real = [e for b in recorded.get(rid, []) for e in b if e["type"] == "BlockStored"]
        mine = [e for b in batches for e in b if e["type"] == "BlockStored"]
        for a, b in zip(real, mine, strict=True):
            if (a["parent_block_hash"] is None) != (b["parent_block_hash"] is None):
                raise AssertionError(f"{rid}: a chain starts in one and not the other")
            # the blocks inside the prompt hold the same tokens (the replies differ: a model's own)
            n = max(0, min(len(a["token_ids"]), len(prompt)))
            if a["parent_block_hash"] is None and n:
                assert b["token_ids"][:n] == a["token_ids"][:n] == prompt[:n], rid
                compared += 1
            assert a["extra_keys"] == b["extra_keys"], rid  # cache_salt on block 0 included
    assert compared >= 5


def test_wire_encoding_is_the_recorded_one() -> None:
    """msgpack as the sim writes it (msgpack-python) re-encodes every recorded payload byte for
    byte (msgspec's choices: float64 ts, smallest ints, uint64, str, bin), and frames are
    topic + 8-byte big-endian sequence + payload."""
    for name in ("kv_events.jsonl", "kv_events_bytes_hashes.jsonl"):
        for line in _jsonl(name):
            raw = base64.b64decode(line["payload_b64"])
            assert EventBatch(0, *msgpack.unpackb(raw, raw=False)).payload() == raw
            assert line["topic"] == TOPIC and isinstance(line["seq"], int)


def test_bytes_hashes_are_the_recorded_kind() -> None:
    """With VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0's equivalent: 32-byte digests, like the
    recorded run's, in the same places, and the same batches for the same requests."""
    requests = _jsonl("requests_bytes_hashes.jsonl")
    got = replay(requests, kv_events_int_hashes=False)
    recorded = recorded_batches("kv_events_bytes_hashes.jsonl")

    def hash_kinds(batches: list[list[Any]]) -> set[tuple[str, str, int]]:
        out = set()
        for batch in batches:
            for e in batch:
                for h in e.get("block_hashes", []) + ([e["parent_block_hash"]] if e.get("parent_block_hash") else []):
                    out.add((e["type"], type(h).__name__, len(h) if isinstance(h, bytes) else 0))
        return out

    sim = [b for _, _, bs in got.values() for b in bs]
    real = [b for bs in recorded.values() for b in bs]
    assert hash_kinds(sim) == hash_kinds(real) and ("BlockStored", "bytes", 32) in hash_kinds(real)
    for r in requests:
        assert _summary(got[r["id"]][2]) == _summary(recorded.get(r["id"], [])), r["id"]


def test_event_sources_and_replay_frames_are_the_recorded_ones() -> None:
    """GET /kv_event_sources: vLLM's keys, types and `tcp://*:PORT` form; the replay ROUTER:
    [b"", topic, seq, payload] per batch, then [b"", b"", 0xFF*8, b""], as recorded."""
    recorded_sources = json.loads((FIXTURES / "kv_event_sources.json").read_text())
    replay_frames = [[base64.b64decode(f) for f in m["frames_b64"]] for m in _jsonl("kv_replay.jsonl")]
    assert replay_frames[-1] == [b"", b"", END_SEQ, b""]
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", "topic": TOPIC}
    with serve_in_thread({**recorded_options(), "kv_events_config": config}) as url:
        sources = httpx.get(url + "/kv_event_sources").json()
        assert list(sources) == list(recorded_sources) == ["0"]
        assert shape(sources) == shape(recorded_sources)
        for key in ("endpoint", "replay_endpoint"):
            assert re.fullmatch(r"tcp://\*:\d+", sources["0"][key]) and re.fullmatch(
                r"tcp://\*:\d+", recorded_sources["0"][key]
            )
        assert {k: v for k, v in sources["0"].items() if "endpoint" not in k} == {
            k: v for k, v in recorded_sources["0"].items() if "endpoint" not in k
        }
        tap = KVTap(url)
        try:
            tap.sync(probe_tokens=300)
            frames, end = tap.replay(RECORDING["replay_start_seq"])
        finally:
            tap.close()
    assert end == replay_frames[-1]
    assert frames and all(len(f) == 4 and f[0] == b"" and f[1] == TOPIC.encode() and len(f[2]) == 8 for f in frames)
    assert all(len(f) == 4 and f[:2] == [b"", TOPIC.encode()] and len(f[2]) == 8 for f in replay_frames[:-1])
    assert (
        int.from_bytes(frames[0][2], "big")
        == int.from_bytes(replay_frames[0][2], "big")
        == RECORDING["replay_start_seq"]
    )


def test_models_and_metrics_have_the_recorded_fields() -> None:
    """GET /v1/models: vLLM's card fields and types; /metrics: every series and every
    cache_config_info label the sim exposes exists in the recorded engine's page."""
    real_metrics = (FIXTURES / "metrics.txt").read_text()

    def families(text: str) -> set[str]:
        return set(re.findall(r"^# TYPE (\S+) ", text, re.M))

    def info_labels(text: str) -> dict[str, str]:
        line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
        return dict(re.findall(r'(\w+)="([^"]*)"', line))

    with serve_in_thread(recorded_options()) as url:
        models = httpx.get(url + "/v1/models").json()
        metrics = httpx.get(url + "/metrics").text
    assert shape(models) == shape(MODELS)
    assert models["data"][0]["id"] == MODELS["data"][0]["id"]
    assert models["data"][0]["max_model_len"] == MODELS["data"][0]["max_model_len"]
    assert families(metrics) <= families(real_metrics)
    mine, theirs = info_labels(metrics), info_labels(real_metrics)
    assert set(mine) <= set(theirs)
    assert {k: mine[k] for k in ("block_size", "num_gpu_blocks", "enable_prefix_caching")} == {
        k: theirs[k] for k in ("block_size", "num_gpu_blocks", "enable_prefix_caching")
    }
