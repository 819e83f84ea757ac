"""Decode vLLM's KV cache event messages (ZMQ frames) into plain event objects.

A message is three frames: topic, an 8-byte big-endian sequence number and a msgpack
payload ``[ts, [event, ...], data_parallel_rank]``.  Two event layouts exist in the wild:
vLLM 0.32 sends each event as a **map** with a ``"type"`` tag; vLLM before mid-2026 sent
**positional arrays** with the tag first.  Consumers built for one broke on the other, so
both are read here.  Hashes are 64-bit unsigned integers by default, raw digest bytes with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; both are kept as they come (hashable either way).

The input comes from the network, so nothing here raises: a message that cannot be read is
dropped and its reason returned (the caller counts it); an event of an unknown type, or
with unknown fields, is skipped or read for the fields it knows (newer vLLMs add fields).
Sizes are capped *before* allocation: msgpack's own limits bound every string, byte string,
array and map it would build, and the payload's length is checked first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

# Caps (a message over one is dropped as "too_large"/"malformed", never allocated).
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
_MAX_ARRAY = 4 * 1024 * 1024  # token_ids of one batch (a long prompt's blocks) is the longest array
_MAX_STR = 64 * 1024  # lora names, cache_salt, medium, tags
_MAX_BIN = 4096  # raw digests (32 bytes for sha256) and embedding digests in extra_keys
_MAX_MAP = 64  # an event's fields
MAX_HASH_BYTES = 64

#: The reasons a message is dropped, as metric labels (bounded).
DROP_REASONS = ("frames", "sequence", "too_large", "malformed", "shape")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks the engine cached: ``token_ids`` are all their tokens, in order."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[Any]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted."""

    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine's prefix cache was reset (``/reset_prefix_cache``)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class Batch:
    """One decoded message: what one scheduler step changed on one data-parallel rank."""

    topic: bytes
    seq: int
    ts: float
    dp_rank: int
    events: list[Event]
    skipped: dict[str, int] = field(default_factory=dict)  # event-level skips by reason (counted, not fatal)


class Dropped(Exception):
    """A message the decoder could not read; ``reason`` is one of :data:`DROP_REASONS`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# Field order of the positional (array_like) layout, after the tag, as msgspec encodes the
# classes' fields (trailing fields at their default are omitted).
STORED_FIELDS = (
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
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def unpack(payload: bytes) -> Any:
    """msgpack with every size capped before anything is allocated (raises on bad input)."""
    return msgpack.unpackb(
        payload,
        raw=False,
        strict_map_key=False,
        use_list=True,
        max_str_len=_MAX_STR,
        max_bin_len=_MAX_BIN,
        max_array_len=_MAX_ARRAY,
        max_map_len=_MAX_MAP,
        max_ext_len=0,
    )


def decode_frames(frames: list[bytes]) -> Batch:
    """A SUB message (``[topic, seq, payload]``) as a :class:`Batch`; raises :class:`Dropped`."""
    if len(frames) != 3:
        raise Dropped("frames")
    topic, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise Dropped("sequence")
    return decode_payload(topic, int.from_bytes(seq_bytes, "big"), payload)


def decode_payload(topic: bytes, seq: int, payload: bytes) -> Batch:
    """The payload of one message; raises :class:`Dropped` (never anything else)."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise Dropped("too_large")
    try:
        body = unpack(payload)
    except Exception as exc:  # msgpack raises many types (ExtraData, StackError, ValueError, ...)
        raise Dropped("malformed") from exc
    if not isinstance(body, list) or len(body) < 2 or not isinstance(body[1], list):
        raise Dropped("shape")
    ts = body[0] if isinstance(body[0], int | float) and not isinstance(body[0], bool) else 0.0
    rank = body[2] if len(body) > 2 and type(body[2]) is int and 0 <= body[2] < 1 << 16 else 0
    batch = Batch(topic, seq, float(ts), rank, [])
    for raw in body[1]:
        event, skip = decode_event(raw)
        if event is not None:
            batch.events.append(event)
        else:
            batch.skipped[skip] = batch.skipped.get(skip, 0) + 1
    return batch


def decode_events(raw: Any) -> list[Event]:
    """Events already unpacked (an in-process source: the simulator's callback hands over the
    structures a msgpack decoder yields); those that cannot be read are left out."""
    if not isinstance(raw, list):
        return []
    return [event for event, _ in map(decode_event, raw) if event is not None]


def decode_event(raw: Any) -> tuple[Event | None, str]:
    """One event in either layout: (event, "") or (None, why it was skipped)."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS if tag == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        return None, "bad_event"
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        hashes = _hashes(fields.get("block_hashes"))
        if hashes is None:
            return None, "bad_event"
        return BlockRemoved(hashes, _str(fields.get("medium")), _int(fields.get("group_idx"))), ""
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(), ""
    return None, "unknown_type"


def _stored(fields: dict[str, Any]) -> tuple[Event | None, str]:
    hashes = _hashes(fields.get("block_hashes"))
    parent = fields.get("parent_block_hash")
    tokens = fields.get("token_ids")
    size = fields.get("block_size")
    if hashes is None or not isinstance(tokens, list) or type(size) is not int or size <= 0:
        return None, "bad_event"
    if parent is not None and not _is_hash(parent):
        return None, "bad_event"
    extra = fields.get("extra_keys")
    return (
        BlockStored(
            hashes,
            parent,
            tokens,
            size,
            _str(fields.get("lora_name")),
            _str(fields.get("medium")),
            extra if isinstance(extra, list) else None,
            _int(fields.get("group_idx")),
            _str(fields.get("kv_cache_spec_kind")),
        ),
        "",
    )


def _is_hash(value: Any) -> bool:
    if type(value) is int:
        return value >= 0
    return isinstance(value, bytes) and 0 < len(value) <= MAX_HASH_BYTES


def _hashes(value: Any) -> list[int | bytes] | None:
    if not isinstance(value, list) or not all(_is_hash(h) for h in value):
        return None
    return value


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    return value if type(value) is int else None
