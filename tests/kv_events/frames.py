"""Hand-made vLLM KV event messages, in both wire layouts, for the decoder and index tests.

Written from NOTES §9 and vLLM 0.32's ``kv_events.py`` field order (read, not copied):
0.32 encodes each event as a map tagged ``"type"``; older engines as an array whose first
item is the tag.  Fields at their default are omitted, as msgspec's ``omit_defaults`` does.
"""

from __future__ import annotations

from typing import Any

import msgpack

from gateway.kv_events.decoder import STORED_FIELDS

STORED_ORDER = STORED_FIELDS  # the positional layout, as the decoder reads it


def stored(
    hashes: list[Any],
    tokens: list[int],
    block_size: int,
    parent: Any = None,
    *,
    positional: bool = False,
    **extra: Any,
) -> Any:
    fields: dict[str, Any] = {
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }
    if positional:
        values = [fields.get(name) for name in STORED_ORDER]
        while values and values[-1] is None:
            values.pop()
        return ["BlockStored", *values]
    return {"type": "BlockStored", **{k: v for k, v in fields.items() if v is not None or k == "parent_block_hash"}}


def removed(hashes: list[Any], *, positional: bool = False, group_idx: int | None = None) -> Any:
    if positional:
        return ["BlockRemoved", hashes, "GPU"] + ([group_idx] if group_idx is not None else [])
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
    if group_idx is not None:
        event["group_idx"] = group_idx
    return event


def cleared(*, positional: bool = False) -> Any:
    return ["AllBlocksCleared"] if positional else {"type": "AllBlocksCleared"}


def payload(events: list[Any], dp_rank: int = 0, ts: float = 1.0) -> bytes:
    return msgpack.packb([ts, events, dp_rank])


def message(seq: int, events: list[Any], dp_rank: int = 0, topic: bytes = b"") -> list[bytes]:
    """The three ZMQ frames of one message."""
    return [topic, seq.to_bytes(8, "big"), payload(events, dp_rank)]


def hashes_for(n: int, start: int = 1000, *, digest: bool = False) -> list[Any]:
    """``n`` distinct engine hashes: 64-bit ints, or 32-byte raw digests."""
    if digest:
        return [(start + i).to_bytes(32, "big") for i in range(n)]
    return [(start + i) * 0x9E3779B97F4A7C15 % (1 << 64) for i in range(n)]
