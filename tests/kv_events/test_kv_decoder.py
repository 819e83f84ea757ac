"""The KV event decoder on hand-made frames: both layouts, both hash kinds, unknown fields and
types, truncated and hostile msgpack.  Nothing raises; everything dropped is counted."""

from __future__ import annotations

import msgpack
import pytest

from gateway.kv_events.decoder import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Dropped,
    decode_frames,
    decode_payload,
)
from tests.kv_events.frames import cleared, hashes_for, message, payload, removed, stored


@pytest.mark.parametrize("positional", [False, True], ids=["tagged-map", "positional-array"])
@pytest.mark.parametrize("digest", [False, True], ids=["int-hashes", "raw-digests"])
def test_both_layouts_and_hash_kinds_decode_alike(positional: bool, digest: bool) -> None:
    hashes = hashes_for(2, digest=digest)
    events = [
        stored(hashes, list(range(32)), 16, positional=positional, extra_keys=[["salt-a"], None]),
        removed(hashes[1:], positional=positional),
        cleared(positional=positional),
    ]
    batch = decode_frames(message(7, events, dp_rank=2, topic=b"kv"))
    assert (batch.topic, batch.seq, batch.dp_rank) == (b"kv", 7, 2)
    first, second, third = batch.events
    assert isinstance(first, BlockStored)
    assert first.block_hashes == hashes and first.parent_block_hash is None
    assert first.token_ids == list(range(32)) and first.block_size == 16 and first.medium == "GPU"
    assert first.extra_keys == [["salt-a"], None]
    assert isinstance(second, BlockRemoved) and second.block_hashes == hashes[1:]
    assert isinstance(third, AllBlocksCleared)
    assert batch.skipped == {}


def test_unknown_fields_are_ignored_and_unknown_types_skipped_and_counted() -> None:
    event = stored(hashes_for(1), list(range(16)), 16)
    event.update({"session_id": "abc", "locality": "LOCAL", "a_field_from_2027": [1, {"x": 2}]})
    positional = ["BlockRemoved", hashes_for(1), "GPU", 0, "LOCAL", "owner", "future", "fields"]
    batch = decode_frames(message(0, [event, {"type": "BlockOffloaded", "x": 1}, ["Mystery", 1], positional]))
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved"]
    assert batch.skipped == {"unknown_type": 2}


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "BlockStored", "block_hashes": "nope", "token_ids": [], "block_size": 16},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 0},
        {"type": "BlockStored", "block_hashes": [-5], "token_ids": [1], "block_size": 16},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": "x", "block_size": 16},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": 1.5, "token_ids": [], "block_size": 16},
        {"type": "BlockRemoved", "block_hashes": [b"x" * 65]},
        {"type": "BlockRemoved"},
        42,
        [],
        [17, 1, 2],
    ],
)
def test_malformed_events_are_skipped_not_raised(raw: object) -> None:
    batch = decode_frames(message(0, [raw, cleared()]))
    assert [type(e).__name__ for e in batch.events] == ["AllBlocksCleared"]
    assert batch.skipped == {"bad_event": 1}


def _reason(frames: list[bytes]) -> str:
    with pytest.raises(Dropped) as caught:
        decode_frames(frames)
    return caught.value.reason


def test_bad_frames_and_sequences_are_dropped_with_a_reason() -> None:
    good = message(1, [cleared()])
    assert _reason(good[:2]) == "frames"
    assert _reason([*good, b"extra"]) == "frames"
    assert _reason([b"", b"\x00\x01", good[2]]) == "sequence"


def test_truncated_msgpack_is_dropped_at_every_cut() -> None:
    whole = payload([stored(hashes_for(3), list(range(48)), 16), removed(hashes_for(1))])
    reasons = set()
    for cut in range(len(whole)):
        with pytest.raises(Dropped) as caught:
            decode_payload(b"", 0, whole[:cut])
        reasons.add(caught.value.reason)
    assert reasons <= {"malformed", "shape"}
    assert "malformed" in reasons


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (b"\xdd\x7f\xff\xff\xff", "malformed"),  # an array header claiming 2^31 items, no items
        (b"\xdf\x7f\xff\xff\xff", "malformed"),  # a map of 2^31 entries
        (b"\xdb\x7f\xff\xff\xff" + b"x" * 10, "malformed"),  # a 2 GiB string
        (b"\xc6\x7f\xff\xff\xff", "malformed"),  # a 2 GiB byte string
        (b"\x91" * 100_000 + b"\x90", "malformed"),  # nested 100,000 deep
        (b"\xc1", "malformed"),  # a reserved byte
        (msgpack.packb([1.0, [cleared()], 0]) + b"\x00", "malformed"),  # trailing bytes
        (msgpack.packb({"ts": 1}), "shape"),
        (msgpack.packb([1.0, "events", 0]), "shape"),
        (msgpack.packb([1.0]), "shape"),
        (msgpack.packb([1.0, [], 0], use_bin_type=False)[:-1] + b"\xd4\x01\x02", "malformed"),  # ext type
        (msgpack.packb([1.0, [{"type": b"\xff\xfe".decode("latin-1")}], 0]), None),
        (b"\xa3\xff\xfe\xfd", "malformed"),  # invalid UTF-8 in a str
    ],
)
def test_hostile_payloads_never_raise_anything_but_dropped(blob: bytes, reason: str | None) -> None:
    if reason is None:
        batch = decode_payload(b"", 0, blob)
        assert batch.skipped == {"unknown_type": 1}
        return
    with pytest.raises(Dropped) as caught:
        decode_payload(b"", 0, blob)
    assert caught.value.reason == reason


def test_an_oversized_payload_is_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.kv_events.decoder as decoder

    monkeypatch.setattr(decoder, "MAX_PAYLOAD_BYTES", 64)
    with pytest.raises(Dropped) as caught:
        decode_payload(b"", 0, payload([stored(hashes_for(4), list(range(64)), 16)]))
    assert caught.value.reason == "too_large"


def test_bad_header_fields_default_instead_of_raising() -> None:
    batch = decode_payload(b"", 3, msgpack.packb(["not-a-time", [cleared()], "rank?"]))
    assert (batch.ts, batch.dp_rank, len(batch.events)) == (0.0, 0, 1)
    batch = decode_payload(b"", 3, msgpack.packb([2.5, [cleared()]]))  # no rank: omitted default
    assert (batch.ts, batch.dp_rank) == (2.5, 0)
