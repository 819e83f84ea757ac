"""A tiny KV event consumer for the simulator tests: SUB + replay DEALER + a local decoder.

Deliberately independent of the gateway's decoder (gateway/kv_events/): it decodes exactly
what vLLM 0.32 documents, both layouts, so a sim that drifts from the wire format fails here.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import msgpack
import zmq

# vLLM 0.32's field order (msgspec struct order): also the positional layout's order
FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}
END_SEQ = b"\xff" * 8
_MASK = (1 << 64) - 1
_probe = itertools.count()


@dataclass
class Batch:
    topic: bytes
    seq: int
    ts: float
    events: list[dict[str, Any]]  # normalized to maps
    dp_rank: int
    payload: bytes
    raw_events: list[Any]  # as decoded, before normalizing


def decode(topic: bytes, seq: bytes, payload: bytes) -> Batch:
    assert len(seq) == 8
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    return Batch(topic, int.from_bytes(seq, "big"), ts, [normalize(e) for e in events], rank, payload, events)


def normalize(event: Any) -> dict[str, Any]:
    if isinstance(event, dict):
        return event
    tag, *values = event
    names = FIELDS[tag]
    assert len(values) <= len(names)
    return {"type": tag, **dict(zip(names, values, strict=False))}


def int_hash(h: int | bytes) -> int:
    return int.from_bytes(h, "big") & _MASK if isinstance(h, bytes) else h


class KVIndex:
    """What the events say the cache holds: copies per block hash (integer form)."""

    def __init__(self) -> None:
        self.copies: Counter[int] = Counter()
        self.tokens: dict[int, list[int]] = {}

    def apply(self, batch: Batch) -> None:
        for e in batch.events:
            if e["type"] == "BlockStored":
                bs = e["block_size"]
                for i, h in enumerate(e["block_hashes"]):
                    self.copies[int_hash(h)] += 1
                    self.tokens[int_hash(h)] = e["token_ids"][i * bs : (i + 1) * bs]
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    key = int_hash(h)
                    assert self.copies[key] > 0, "removed a block never stored"
                    self.copies[key] -= 1
                    if not self.copies[key]:
                        del self.copies[key]
            else:
                self.copies.clear()

    @property
    def cached(self) -> set[int]:
        return set(self.copies)


class KVTap:
    """A SUB on a sim's publisher (synced: nothing published after :meth:`sync` is missed)."""

    def __init__(self, url: str) -> None:
        self.url = url
        source = httpx.get(url + "/kv_event_sources").json()["0"]
        self.source = source
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(source["endpoint"].replace("*", "127.0.0.1"))
        self.replay_endpoint = (source["replay_endpoint"] or "").replace("*", "127.0.0.1") or None

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def sync(self, probe_tokens: int = 40, timeout: float = 10.0) -> Batch:
        """A subscription takes effect a moment after connecting (ZMQ's slow joiner): send
        fresh prompts (at least one full block of ``probe_tokens``) until one's events arrive;
        returns that batch."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            prompt = [1000 + next(_probe) % 50000] * probe_tokens  # never cached before
            httpx.post(self.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}).raise_for_status()
            if self.sub.poll(100):
                batch = self.recv()
                while self.sub.poll(0):
                    batch = self.recv()
                return batch
        raise AssertionError("no KV events arrived")

    def recv(self, timeout_ms: int = 5000) -> Batch:
        if not self.sub.poll(timeout_ms):
            raise AssertionError("no KV event batch within the deadline")
        frames = self.sub.recv_multipart()
        assert len(frames) == 3, frames
        return decode(*frames)

    def drain(self) -> list[Batch]:
        """Every batch already delivered (after the HTTP answers that caused them)."""
        out = []
        while self.sub.poll(200):
            out.append(self.recv())
        return out

    def replay(self, start: int, timeout_ms: int = 5000) -> tuple[list[list[bytes]], list[bytes]]:
        """(frames of each replayed batch, the end frame) from a DEALER, as vLLM documents."""
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got = []
            while True:
                assert dealer.poll(timeout_ms), "replay did not answer"
                frames = dealer.recv_multipart()
                if frames[2] == END_SEQ:
                    return got, frames
                got.append(frames)
        finally:
            dealer.close(linger=0)
