"""The shared-state wire codec: affinity batches and load reports as pub/sub payloads.

Pure encoding and decoding, apart from the Redis transport (:mod:`gateway.state.affinity_sync`)
so the format can be read, tested and kept compatible on its own.  Every decoder checks what
a hostile or older peer may send (types, ranges, sizes) and raises ``ValueError`` on it; the
transport still guards each message against any exception.

Wire format (one pub/sub message per batch, JSON)::

    {"v": 1, "pod": "<id>", "records": [[route, replica, prompt_tokens or 0, "<keys>"], ...]}

where ``<keys>`` is the base64 of the stored block keys as little-endian u64, deepest first.
Where the sender models the replica's KV cache (``replica_cache_tokens``), the batch also
carries what the keys weigh there — ``"weights": [[record_position, "<u32s>"], ...]``, the
base64 of little-endian u32 token counts for the first keys of that record (the rest weigh
one stride of blocks) — so a peer's model of the same replica fills as the sender's does
instead of weighing every key alike (a 32k-token prompt's text keys each stand for ~1,000
tokens, its window keys for 64).  A separate field, so older versions read the records and
ignore it.
A batch may also carry the conversation starts placed behind shared heads since the last one,
``"starts": [[route, head_key], ...]`` (:mod:`gateway.routing.starts`: every process then counts
the fleet's starts), and the normalization places new to the sender or newly seen to vary,
``"varies": [[route, place_digest, value_digest or 0 (varies)], ...]`` (:mod:`gateway.prefix.learn`:
a template's warm-up is paid once per fleet).  The last message of a catch-up snapshot
(:mod:`gateway.state.catchup`) also carries
``"catch_up_end": true`` (with no records when the sender had none), the sender's whole list of
varying places and its start counts, ``"demand": {route: [recent_starts, [[head_key, count],
...]]}``: a process that has just joined takes the first it hears and is ready
(``CatchUp.readiness``).  Older versions ignore these fields.
A batch may also carry withdrawals, ``"withdrawn": [[position, route, replica, "<keys>"], ...]``:
keys a record added that the sender took back because the replica did not serve the request
(no 2xx answer), to be dropped for that replica after the batch's first ``position`` records
are applied (the order the sender made them in).  A separate field: older versions ignore it
(and keep the record until their LRU evicts it, as before).
The channel ``<channel>:load`` carries each process's load reports
(:mod:`gateway.state.peer_load`),
``{"v": 1, "pod": "<id>", "load": {"<replica>": [in_flight, queued_prefill_tokens], ...}}``,
published every ``load_interval_ms`` when ``state.share_load`` is on.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from gateway.state.peer_load import Report, load_rows

WIRE_VERSION = 1
MAX_RECORDS_PER_MESSAGE = 512
MAX_KEYS_PER_RECORD = 65_536
MAX_MESSAGE_BYTES = 8 << 20


class Record(NamedTuple):
    """One affinity record: ``replica`` of ``route`` holds these stored keys (deepest first)."""

    route: str
    replica: str
    keys: list[int]
    prompt_tokens: int | None
    weights: list[int] | None = None  # the first keys' weights in a modelled cache (KeyWeights.explicit)


class Withdrawal(NamedTuple):
    """Keys a record added for ``replica`` of ``route``, taken back (it did not serve)."""

    route: str
    replica: str
    keys: list[int]


Start = tuple[str, int]  # route, shared head key
Sighting = tuple[str, int, int]  # route, normalization place digest, its value's digest (0: varies)
Demand = dict[str, tuple[float, list[tuple[int, float]]]]  # route -> HeadDemand.export()
MAX_DEMAND_HEADS = 1024  # per route in a catch-up snapshot
MAX_VARYING_PLACES = 4096  # per route in a catch-up snapshot
MAX_VARIES_PER_MESSAGE = 65_536
_U64 = 1 << 64
_U32_MAX = (1 << 32) - 1


def encode(
    pod: str,
    records: Sequence[Record],
    *,
    starts: Sequence[Start] = (),
    varies: Sequence[Sighting] = (),
    catch_up_end: bool = False,
    demand: Demand | None = None,
    withdrawn: Sequence[tuple[int, Withdrawal]] = (),
) -> bytes:
    """One batch as a pub/sub payload (see the module docstring); ``withdrawn``: (position,
    withdrawal) pairs, a withdrawal applying after the first ``position`` of ``records``."""
    rows = [
        [r.route, r.replica, r.prompt_tokens or 0, base64.b64encode(struct.pack(f"<{len(r.keys)}Q", *r.keys)).decode()]
        for r in records
    ]
    message: dict[str, Any] = {"v": WIRE_VERSION, "pod": pod, "records": rows}
    if withdrawn:
        message["withdrawn"] = [[i, w.route, w.replica, _pack_keys(w.keys)] for i, w in withdrawn]
    weights = [
        [i, base64.b64encode(struct.pack(f"<{len(r.weights)}I", *(min(w, _U32_MAX) for w in r.weights))).decode()]
        for i, r in enumerate(records)
        if r.weights
    ]
    if weights:
        message["weights"] = weights
    if starts:
        message["starts"] = [[route, head] for route, head in starts]
    if varies:
        message["varies"] = [list(row) for row in varies]
    if catch_up_end:
        message["catch_up_end"] = True
        if demand:
            message["demand"] = {
                route: [round(total, 3), [[head, round(count, 3)] for head, count in heads]]
                for route, (total, heads) in demand.items()
            }
    return json.dumps(message, separators=(",", ":")).encode()


def _pack_keys(keys: Sequence[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(keys)}Q", *keys)).decode()


def _unpack_keys(packed: str) -> list[int]:
    """1..``MAX_KEYS_PER_RECORD`` u64 keys from their base64 (as a record's); ``ValueError`` else."""
    try:
        raw = base64.b64decode(packed, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("keys are not base64") from None
    if len(raw) % 8 or not raw or len(raw) // 8 > MAX_KEYS_PER_RECORD:
        raise ValueError(f"keys must be 1..{MAX_KEYS_PER_RECORD} u64 values")
    return list(struct.unpack(f"<{len(raw) // 8}Q", raw))


def _is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value < _U64


def _is_count(value: Any) -> bool:
    return type(value) in (int, float) and 0 <= value < 1e12


def _route_u64_rows(message: Mapping[str, Any], field: str, width: int, limit: int) -> list[tuple[Any, ...]]:
    """``message[field]``: at most ``limit`` rows ``[route, u64, ...]`` of ``width`` items; ``ValueError`` else."""
    rows = message.get(field, [])
    if not isinstance(rows, list) or len(rows) > limit:
        raise ValueError(f"bad {field}")
    for row in rows:
        if not (isinstance(row, list) and len(row) == width and isinstance(row[0], str) and all(map(_is_u64, row[1:]))):
            raise ValueError(f"a row of {field} must be [route, {width - 1} u64 values]")
    return [tuple(row) for row in rows]


def decode_starts(message: Mapping[str, Any]) -> list[Start]:
    """``[[route, head key], ...]``."""
    return _route_u64_rows(message, "starts", 2, MAX_RECORDS_PER_MESSAGE)  # type: ignore[return-value]


def decode_varies(message: Mapping[str, Any]) -> list[Sighting]:
    """``[[route, place digest, value digest or 0], ...]``."""
    return _route_u64_rows(message, "varies", 3, MAX_VARIES_PER_MESSAGE)  # type: ignore[return-value]


def decode_demand(message: Mapping[str, Any]) -> Demand:
    routes = message.get("demand", {})
    if not isinstance(routes, dict) or len(routes) > 1024:
        raise ValueError("bad demand")
    out: Demand = {}
    for route, row in routes.items():
        if not (isinstance(row, list) and len(row) == 2 and _is_count(row[0]) and isinstance(row[1], list)):
            raise ValueError("a route's demand must be [recent_starts, [[head, count], ...]]")
        heads = row[1]
        if len(heads) > MAX_DEMAND_HEADS or not all(
            isinstance(h, list) and len(h) == 2 and _is_u64(h[0]) and _is_count(h[1]) for h in heads
        ):
            raise ValueError("bad demand heads")
        out[route] = (float(row[0]), [(head, float(count)) for head, count in heads])
    return out


def encode_load(pod: str, report: Report) -> bytes:
    """This process's per-replica load as a pub/sub payload (see :mod:`gateway.state.peer_load`)."""
    return json.dumps({"v": WIRE_VERSION, "pod": pod, "load": load_rows(report)}, separators=(",", ":")).encode()


def parse_message(payload: bytes | str) -> dict[str, Any]:
    """A version-1 message with a string ``pod``; ``ValueError`` otherwise."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(payload)} bytes is over {MAX_MESSAGE_BYTES}")
    try:
        message = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON: {type(exc).__name__}") from None
    if not isinstance(message, dict) or message.get("v") != WIRE_VERSION or not isinstance(message.get("pod"), str):
        raise ValueError("not a version-1 message from a pod")
    return message


def decode(payload: bytes | str) -> tuple[str, list[Record]]:
    """``(pod, records)`` from an affinity batch; ``ValueError`` if it is not a valid one."""
    message = parse_message(payload)
    return message["pod"], decode_records(message)


def decode_records(message: Mapping[str, Any]) -> list[Record]:
    return [packed.unpack() for packed in decode_packed(message)]


class PackedRecord(NamedTuple):
    """A validated record whose keys are still packed: unpacking ~780k keys into Python ints
    takes ~0.2 s, so a receiver unpacks one record at a time between turns of its event loop."""

    route: str
    replica: str
    raw: bytes  # the keys as little-endian u64
    prompt_tokens: int | None
    weights: list[int] | None = None

    @property
    def key_count(self) -> int:
        return len(self.raw) // 8

    def unpack(self) -> Record:
        keys = list(struct.unpack(f"<{self.key_count}Q", self.raw))
        return Record(self.route, self.replica, keys, self.prompt_tokens, self.weights)


def decode_packed(message: Mapping[str, Any]) -> list[PackedRecord]:
    """The message's records, all validated (``ValueError`` on any), keys left packed."""
    rows = message.get("records")
    if not isinstance(rows, list) or len(rows) > MAX_RECORDS_PER_MESSAGE:
        raise ValueError("bad records")
    records: list[PackedRecord] = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 4):
            raise ValueError("a record must be [route, replica, prompt_tokens, keys]")
        route, replica, prompt_tokens, packed = row
        if not (isinstance(route, str) and isinstance(replica, str) and isinstance(packed, str)):
            raise ValueError("bad record field types")
        if type(prompt_tokens) is not int or prompt_tokens < 0:
            raise ValueError("prompt_tokens must be an int >= 0")
        try:  # strict: only the alphabet and padding (b64decode's validate=True, 10x faster)
            raw = binascii.a2b_base64(packed, strict_mode=True)
        except (binascii.Error, ValueError):
            raise ValueError("keys are not base64") from None
        if len(raw) % 8 or not raw or len(raw) // 8 > MAX_KEYS_PER_RECORD:
            raise ValueError(f"keys must be 1..{MAX_KEYS_PER_RECORD} u64 values")
        records.append(PackedRecord(route, replica, raw, prompt_tokens or None))
    return _with_weights(records, message.get("weights"))


def decode_withdrawn(message: Mapping[str, Any], records: int) -> list[tuple[int, Withdrawal]]:
    """``[[position, route, replica, keys], ...]`` (see the module docstring), in order:
    positions 0..``records`` (the message's record count), never decreasing."""
    rows = message.get("withdrawn", [])
    if not isinstance(rows, list) or len(rows) > MAX_RECORDS_PER_MESSAGE:
        raise ValueError("bad withdrawn")
    out: list[tuple[int, Withdrawal]] = []
    last = 0
    for row in rows:
        if not (isinstance(row, list) and len(row) == 4 and type(row[0]) is int):
            raise ValueError("a withdrawal must be [position, route, replica, keys]")
        position, route, replica, packed = row
        if not (isinstance(route, str) and isinstance(replica, str) and isinstance(packed, str)):
            raise ValueError("bad withdrawal field types")
        if not last <= position <= records:
            raise ValueError("withdrawals must follow the records they take back, in order")
        last = position
        out.append((position, Withdrawal(route, replica, _unpack_keys(packed))))
    return out


def _with_weights(records: list[PackedRecord], rows: Any) -> list[PackedRecord]:
    """``records`` with the weights a message carries for them (see the module docstring)."""
    if rows is None:
        return records
    if not isinstance(rows, list) or len(rows) > len(records):
        raise ValueError("bad weights")
    for row in rows:
        if not (isinstance(row, list) and len(row) == 2 and type(row[0]) is int and isinstance(row[1], str)):
            raise ValueError("a weights row must be [record_position, packed u32s]")
        position, packed = row
        if not 0 <= position < len(records):
            raise ValueError("weights for a record the message does not hold")
        try:
            raw = base64.b64decode(packed, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("weights are not base64") from None
        count = len(raw) // 4
        if len(raw) % 4 or not count or count > records[position].key_count:
            raise ValueError("weights must be 1..len(keys) u32 values")
        values = [max(1, w) for w in struct.unpack(f"<{count}I", raw)]
        records[position] = records[position]._replace(weights=values)
    return records
