"""Share prefix-affinity records between gateway processes through Redis pub/sub.

Several gateway pods behind one Kubernetes Service each see only the requests the Service
sends them, so with per-process state turn 2 of a conversation can reach a pod that never
saw turn 1 and miss the replica holding its history.  Every pod therefore publishes the
affinity records it makes — (route, replica, the prompt's stored block keys, its length
past the window) — and applies every other pod's, so all indexes converge to the fleet's.

Why pub/sub and write-behind, not a Redis lookup per request: the request path must never
wait on a network round trip, and affinity is a hint (a lost record costs at most one cache
miss, never a wrong answer).  A record is queued in memory (bounded; the oldest are dropped
first), published in small batches every ``batch_interval_ms``, and applied by peers within
milliseconds.  While Redis is unreachable the gateway keeps routing on its own index,
retries with backoff, and says so once in the log and in ``prefix_gateway_state_sync_*``
metrics.  A pod that starts later gets a snapshot of its peers' recent records
(:mod:`gateway.state.catchup`) and, until it has, answers ``/ready`` with 503.

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
The channel ``<channel>:load`` carries each process's load reports
(:mod:`gateway.state.peer_load`),
``{"v": 1, "pod": "<id>", "load": {"<replica>": [in_flight, queued_prefill_tokens], ...}}``,
published every ``load_interval_ms`` when ``state.share_load`` is on.
Messages from this process, for unknown routes or replicas, or malformed, are skipped and
counted; none of them can raise into the gateway.  With a shared secret every message is
wrapped in an HMAC envelope (:mod:`gateway.state.signing`) and anything unsigned or badly
signed is dropped and counted (``rejected``): another client of the same Redis cannot forge
load or affinity.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import struct
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

from gateway.prefix.learn import VarianceLearner
from gateway.routing.affinity import AffinityIndex, KeyWeights
from gateway.routing.starts import HeadDemand
from gateway.state.peer_load import PeerLoad, Report, load_rows, parse_load
from gateway.state.signing import Signer
from gateway.tasks import cancel_and_wait

log = logging.getLogger("prefix_gateway.state")

WIRE_VERSION = 1
MAX_RECORDS_PER_MESSAGE = 512
MAX_KEYS_PER_RECORD = 65_536
MAX_MESSAGE_BYTES = 8 << 20
_LOAD_HEARTBEAT_S = 1.0  # a load report goes out at least this often, changed or not
_SILENCE_PING_S = 15.0  # no message for this long: ping the server ...
_PONG_WAIT_S = 5.0  # ... and reconnect if nothing answers within this
_BACKOFF_START_S = 0.5
_BACKOFF_MAX_S = 10.0


class Record(NamedTuple):
    """One affinity record: ``replica`` of ``route`` holds these stored keys (deepest first)."""

    route: str
    replica: str
    keys: list[int]
    prompt_tokens: int | None
    weights: list[int] | None = None  # the first keys' weights in a modelled cache (KeyWeights.explicit)


Start = tuple[str, int]  # route, shared head key
Sighting = tuple[str, int, int]  # route, normalization place digest, its value's digest (0: varies)
Demand = dict[str, tuple[float, list[tuple[int, float]]]]  # route -> HeadDemand.export()
MAX_DEMAND_HEADS = 1024  # per route in a catch-up snapshot
MAX_VARYING_PLACES = 4096  # per route in a catch-up snapshot
MAX_VARIES_PER_MESSAGE = 65_536
_U64 = 1 << 64
_U32_MAX = (1 << 32) - 1


@dataclass
class SyncStats:
    """Counters for ``/metrics`` and ``/admin/stats`` (read at scrape time)."""

    connected: bool = False
    published: int = 0  # records sent to Redis
    applied: int = 0  # records from peers applied to a local index
    ignored: int = 0  # records from peers for a route or replica this process does not have
    dropped: int = 0  # local records never published (queue full, or Redis down)
    errors: int = 0  # failed Redis calls and malformed messages
    rejected: int = 0  # messages dropped for a missing, wrong or stale signature (state.secret_env)
    peers: int = 0  # other gateway processes whose load reports are current
    snapshots_heard: int = 0  # catch-up snapshots that ended (a peer's answer to a newcomer)
    starts_applied: int = 0  # peers' conversation starts behind shared heads, counted here too
    varies_applied: int = 0  # normalization places peers saw vary, learned here too

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def encode(
    pod: str,
    records: Sequence[Record],
    *,
    starts: Sequence[Start] = (),
    varies: Sequence[Sighting] = (),
    catch_up_end: bool = False,
    demand: Demand | None = None,
) -> bytes:
    """One batch as a pub/sub payload (see the module docstring)."""
    rows = [
        [r.route, r.replica, r.prompt_tokens or 0, base64.b64encode(struct.pack(f"<{len(r.keys)}Q", *r.keys)).decode()]
        for r in records
    ]
    message: dict[str, Any] = {"v": WIRE_VERSION, "pod": pod, "records": rows}
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
    rows = message.get("records")
    if not isinstance(rows, list) or len(rows) > MAX_RECORDS_PER_MESSAGE:
        raise ValueError("bad records")
    records: list[Record] = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 4):
            raise ValueError("a record must be [route, replica, prompt_tokens, keys]")
        route, replica, prompt_tokens, packed = row
        if not (isinstance(route, str) and isinstance(replica, str) and isinstance(packed, str)):
            raise ValueError("bad record field types")
        if type(prompt_tokens) is not int or prompt_tokens < 0:
            raise ValueError("prompt_tokens must be an int >= 0")
        try:
            raw = base64.b64decode(packed, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("keys are not base64") from None
        if len(raw) % 8 or not raw or len(raw) // 8 > MAX_KEYS_PER_RECORD:
            raise ValueError(f"keys must be 1..{MAX_KEYS_PER_RECORD} u64 values")
        keys = list(struct.unpack(f"<{len(raw) // 8}Q", raw))
        records.append(Record(route, replica, keys, prompt_tokens or None))
    return _with_weights(records, message.get("weights"))


def _with_weights(records: list[Record], rows: Any) -> list[Record]:
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
        if len(raw) % 4 or not count or count > len(records[position].keys):
            raise ValueError("weights must be 1..len(keys) u32 values")
        values = [max(1, w) for w in struct.unpack(f"<{count}I", raw)]
        records[position] = records[position]._replace(weights=values)
    return records


class AffinitySync:
    """Publishes this process's affinity records and applies its peers', via one Redis channel."""

    def __init__(
        self,
        redis_url: str,
        channel: str,
        indexes: Mapping[str, AffinityIndex],
        *,
        max_pending: int = 10_000,
        batch_interval_s: float = 0.005,
        pod_id: str | None = None,
        peer_load: PeerLoad | None = None,
        load_interval_s: float = 0.1,
        signer: Signer | None = None,
        demands: Mapping[str, HeadDemand] | None = None,
        learners: Mapping[str, VarianceLearner] | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.channel = channel
        # load reports on their own channel: a process that does not share load never sees them
        self.load_channel = channel + ":load"
        self.pod_id = pod_id or uuid.uuid4().hex[:16]
        self.stats = SyncStats()
        self._indexes = dict(indexes)
        self._demands = dict(demands or {})
        self._learners = dict(learners or {})
        self._pending: deque[Record | None] = deque()  # None: the end of a catch-up snapshot
        self._starts: deque[Start] = deque()
        self._varies: deque[Sighting] = deque()
        self._snapshot_demand: Demand | None = None  # sent with the next snapshot end
        self._max_pending = max_pending
        self._interval = batch_interval_s
        self._wake = asyncio.Event()
        self._redis: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._publish_failing = False
        self.peer_load = peer_load
        self._load_interval = load_interval_s
        self.signer = signer
        self._rejected_warned = False
        self.subscribed_at: float | None = None  # monotonic time of the first subscription
        self._subscribed = asyncio.Event()
        self._attach()

    def _attach(self) -> None:
        for route, index in self._indexes.items():
            index.listener = partial(self._enqueue, route)
        for route, demand in self._demands.items():
            demand.listener = partial(self._enqueue_start, route)
        for route, learner in self._learners.items():
            learner.listener = partial(self._enqueue_varies, route)

    def set_indexes(
        self,
        indexes: Mapping[str, AffinityIndex],
        demands: Mapping[str, HeadDemand] | None = None,
        learners: Mapping[str, VarianceLearner] | None = None,
    ) -> None:
        """A config reload rebuilt routes: share the new indexes (and stop hearing the old ones)."""
        self._detach()
        self._indexes = dict(indexes)
        self._demands = dict(demands or {})
        self._learners = dict(learners or {})
        if self._tasks:  # started: listen now (before start(), start() attaches)
            self._attach()

    def _detach(self) -> None:
        for index in self._indexes.values():
            index.listener = None
        for demand in self._demands.values():
            demand.listener = None
        for learner in self._learners.values():
            learner.listener = None

    @property
    def demands(self) -> Mapping[str, HeadDemand]:
        return self._demands

    @property
    def learners(self) -> Mapping[str, VarianceLearner]:
        return self._learners

    @property
    def indexes(self) -> Mapping[str, AffinityIndex]:
        return self._indexes

    def offer(self, records: Sequence[Record], demand: Demand | None = None, varies: Sequence[Sighting] = ()) -> None:
        """Queue a catch-up snapshot (``gateway.state.catchup``): records that are not new placements,
        then its end with ``demand`` (start counts) and ``varies`` (normalization places known to
        vary), which tells a newcomer it may serve (even with no records: nothing to learn)."""
        for record in records:
            self._enqueue(*record)
        self._snapshot_demand = demand
        self._varies.extend(varies)
        self._push(self._pending, None)

    # -- the request path: O(1), never waits ----------------------------------------------
    def _enqueue(
        self, route: str, replica: str, stored: list[int], prompt_tokens: int | None, weights: list[int] | None = None
    ) -> None:
        if len(stored) > MAX_KEYS_PER_RECORD:  # peers would reject the batch: keep it local
            self.stats.dropped += 1
            return
        self._push(self._pending, Record(route, replica, stored, prompt_tokens, weights))

    def _enqueue_varies(self, route: str, place: int, value: int) -> None:
        self._push(self._varies, (route, place, value))

    def _enqueue_start(self, route: str, head: int) -> None:
        self._push(self._starts, (route, head))

    def _push(self, queue: deque[Any], item: Any) -> None:
        """Queue ``item`` for the publisher; a full queue drops its oldest (counted for records)."""
        if len(queue) >= self._max_pending:
            queue.popleft()
            if queue is self._pending:
                self.stats.dropped += 1
        queue.append(item)
        self._wake.set()

    def _seal(self, payload: bytes) -> bytes:
        return payload if self.signer is None else self.signer.seal(payload)

    # -- peers' records -------------------------------------------------------------------
    def apply(self, payload: bytes | str) -> int:
        """Apply one pub/sub payload from a peer; returns the records applied (never raises)."""
        if self.signer is not None:
            opened = self.signer.open(payload)
            if opened is None:
                self.stats.rejected += 1
                if not self._rejected_warned:  # once: a flood of forgeries must not flood the log
                    self._rejected_warned = True
                    log.warning("affinity sync: dropped an unsigned or badly signed message on %s", self.channel)
                return 0
            payload = opened
        try:
            message = parse_message(payload)
            pod = message["pod"]
            if pod == self.pod_id:
                return 0
            if "load" in message:
                if self.peer_load is not None:
                    self.peer_load.apply(pod, parse_load(message["load"]), time.monotonic())
                return 0
            records = decode_records(message)
            starts = decode_starts(message)
            varies = decode_varies(message)
            ends_snapshot = message.get("catch_up_end") is True
            demand = decode_demand(message) if ends_snapshot else {}
        except Exception as exc:  # ValueError, or anything a hostile payload finds
            self.stats.errors += 1
            log.warning("affinity sync: skipped a malformed message on %s: %s", self.channel, exc)
            return 0
        applied = 0
        for route, replica, keys, prompt_tokens, weights in records:
            index = self._indexes.get(route)
            if index is None or not index.knows(replica):
                self.stats.ignored += 1
                continue
            index.record_stored(replica, keys, prompt_tokens, KeyWeights.of(weights))
            applied += 1
        self.stats.applied += applied
        for route, head in starts:
            head_demand = self._demands.get(route)
            if head_demand is not None:
                head_demand.record_peer(head)
                self.stats.starts_applied += 1
        for route, place, value in varies:
            learner = self._learners.get(route)
            if learner is not None:
                learner.learn_peer(place, value)
                self.stats.varies_applied += 1
        if ends_snapshot:
            if not self.stats.snapshots_heard:  # a newcomer's first: the fleet's counts (one peer's suffice)
                for route, (total, heads) in demand.items():
                    if route in self._demands:
                        self._demands[route].merge(total, heads)
            self.stats.snapshots_heard += 1
        return applied

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect lazily in the background: a Redis outage must not stop the gateway starting."""
        import redis.asyncio as aioredis  # imported here: a memory-only gateway never loads it

        self._attach()
        # timeouts and keepalive: a silently dropped path to Redis must fail calls, not hang them
        # (keepalive is a TCP option: a unix:// URL rejects it)
        keepalive = {} if self.redis_url.startswith("unix://") else {"socket_keepalive": True}
        self._redis = aioredis.from_url(self.redis_url, socket_connect_timeout=2.0, socket_timeout=5.0, **keepalive)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._subscribe_loop()), loop.create_task(self._publish_loop())]
        if self.peer_load is not None:
            self._tasks.append(loop.create_task(self._load_loop()))

    async def stop(self) -> None:
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks = []
        self._detach()
        if self.peer_load is not None:
            self.peer_load.forget_all()
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    def _set_connected(self, connected: bool, error: BaseException | None = None) -> None:
        """The subscription's state (only the subscriber loop calls this): the ``connected`` gauge."""
        if connected and not self.stats.connected:
            log.info("affinity sync: subscribed to Redis channel %s (pod %s)", self.channel, self.pod_id)
        elif not connected and self.stats.connected:
            log.warning("affinity sync: lost Redis (%s); routing on this process's own index until it is back", error)
        elif not connected and error is not None and self.stats.errors == 1:
            log.warning("affinity sync: cannot reach Redis (%s); retrying in the background", error)
        self.stats.connected = connected

    async def _subscribe_loop(self) -> None:
        backoff = _BACKOFF_START_S
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self.channel, self.load_channel)
                self._set_connected(True)
                if self.subscribed_at is None:
                    self.subscribed_at = time.monotonic()
                self._subscribed.set()
                backoff = _BACKOFF_START_S
                loop = asyncio.get_running_loop()
                heard = loop.time()
                pinged: float | None = None
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    now = loop.time()
                    if message is not None:
                        heard, pinged = now, None
                        if message.get("type") == "message":
                            self.apply(message["data"])
                    elif pinged is not None and now - pinged > _PONG_WAIT_S:
                        raise ConnectionError(f"no reply from Redis within {_PONG_WAIT_S:.0f} s")
                    elif pinged is None and now - heard > _SILENCE_PING_S:
                        await pubsub.ping()  # a quiet channel or a dead path: the pong tells
                        pinged = now
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # connection refused/reset, timeouts, protocol errors
                self.stats.errors += 1
                self._set_connected(False, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
            finally:
                with contextlib.suppress(Exception):  # closing a broken connection may fail too
                    await pubsub.aclose()

    async def _publish_loop(self) -> None:
        backoff = _BACKOFF_START_S
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self._interval)  # let a burst of placements share one message
            while self._pending or self._starts or self._varies:
                batch, ends_snapshot = self._next_batch()
                starts = [self._starts.popleft() for _ in range(min(len(self._starts), MAX_RECORDS_PER_MESSAGE))]
                # a snapshot's end carries every place queued before it (they precede "ready")
                varies = [self._varies.popleft() for _ in range(min(len(self._varies), MAX_VARIES_PER_MESSAGE))]
                demand = None
                if ends_snapshot:
                    demand, self._snapshot_demand = self._snapshot_demand, None
                try:
                    payload = encode(
                        self.pod_id, batch, starts=starts, varies=varies, catch_up_end=ends_snapshot, demand=demand
                    )
                    await self._redis.publish(self.channel, self._seal(payload))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    # affinity is a hint: records made while Redis is away are dropped, not replayed
                    self.stats.errors += 1
                    self.stats.dropped += len(batch) + len(self._pending)
                    self._pending.clear()
                    if not self._publish_failing:
                        log.warning("affinity sync: cannot publish to Redis (%s); dropping records meanwhile", exc)
                        self._publish_failing = True
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    break
                self.stats.published += len(batch)
                self._publish_failing = False
                backoff = _BACKOFF_START_S

    def _next_batch(self) -> tuple[list[Record], bool]:
        """Up to ``MAX_RECORDS_PER_MESSAGE`` pending records, stopping after a snapshot's end."""
        batch: list[Record] = []
        while self._pending and len(batch) < MAX_RECORDS_PER_MESSAGE:
            record = self._pending.popleft()
            if record is None:
                return batch, True
            batch.append(record)
        return batch, False

    async def _load_loop(self) -> None:
        """Publish this process's per-replica load every interval (when it changed, or each second).

        Also where stale peer reports expire, so nothing in the body may block for long (the
        publish is bounded by one second) or end the loop (a failure is logged once).  The first
        report waits for the subscription: it is what makes peers send their catch-up snapshot,
        which this process must be listening for.
        """
        assert self.peer_load is not None
        await self._subscribed.wait()
        last: Report | None = None
        sent_at = 0.0
        failing = False
        while True:
            await asyncio.sleep(self._load_interval)
            try:
                now = time.monotonic()
                self.peer_load.expire(now)
                self.stats.peers = self.peer_load.peers
                report = self.peer_load.local_report()
                if report == last and now - sent_at < _LOAD_HEARTBEAT_S:
                    continue
                await asyncio.wait_for(
                    self._redis.publish(self.load_channel, self._seal(encode_load(self.pod_id, report))),
                    _LOAD_HEARTBEAT_S,
                )
                last, sent_at, failing = report, now, False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away (the subscriber loop counts the outage), or a bug
                if not failing:
                    log.warning("affinity sync: cannot publish load (%s); retrying every interval", exc)
                    failing = True
