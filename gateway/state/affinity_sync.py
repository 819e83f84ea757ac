"""Share prefix-affinity records between gateway processes through Redis pub/sub.

Several gateway pods behind one Kubernetes Service each see only the requests the Service
sends them, so with per-process state turn 2 of a conversation can reach a pod that never
saw turn 1 and miss the replica holding its history.  Every pod therefore publishes the
affinity records it makes — (route, replica, the prompt's stored block keys, its length
past the window) — and applies every other pod's, so all indexes converge to the fleet's.
A record is made when the request is placed; if the replica then does not serve it (no 2xx
answer) the keys it added are withdrawn, and the withdrawal follows the record through the
same ordered queue, so peers drop them too.  A peer drops the keys the sender's record added
in the sender's index; where the peer had learned some of them first from elsewhere (its own
requests or a third pod's, in the milliseconds before the sender heard of them) it loses that
hint too — at most one miss, and never a belief the replica holds what it did not compute.

Why pub/sub and write-behind, not a Redis lookup per request: the request path must never
wait on a network round trip, and affinity is a hint (a lost record costs at most one cache
miss, never a wrong answer).  A record is queued in memory (bounded; the oldest are dropped
first), published in small batches every ``batch_interval_ms``, and applied by peers within
milliseconds.  While Redis is unreachable the gateway keeps routing on its own index,
retries with backoff, and says so once in the log and in ``prefix_gateway_state_sync_*``
metrics.  A pod that starts later gets a snapshot of its peers' recent records
(:mod:`gateway.state.catchup`) and, until it has, answers ``/ready`` with 503.

What travels (one JSON batch per publish; load reports on their own channel) is
:mod:`gateway.state.wire`; this module is the transport.  Messages from this process, for
unknown routes or replicas, or malformed, are skipped and counted; none of them can raise
into the gateway.  With a shared secret every message is
wrapped in an HMAC envelope (:mod:`gateway.state.signing`) and anything unsigned or badly
signed is dropped and counted (``rejected``), and a replayed one too (``replayed``): another
client of the same Redis cannot forge load or affinity, nor repeat what a pod sent.

What a peer's message may cost is bounded: a record holds at most ``key_caps`` keys (what one
``max_body_bytes`` prompt can make, :mod:`gateway.state.record_bounds`; more is ``oversize``),
and the subscriber applies a message in chunks of ``APPLY_CHUNK_KEYS`` keys, letting the event
loop run in between (:meth:`AffinitySync.receive`).  A failed publish counts what it held
(``dropped``, ``dropped_sightings``) and keeps a catch-up's end mark queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.prefix.learn import NO_LEARN_SINK, VarianceLearner
from gateway.routing.affinity import AffinityIndex
from gateway.routing.key_weights import KeyWeights
from gateway.routing.sinks import NO_SINK
from gateway.routing.starts import HeadDemand
from gateway.state.peer_load import PeerLoad, Report, parse_load
from gateway.state.signing import Signer
from gateway.state.wire import (
    MAX_KEYS_PER_RECORD,
    MAX_RECORDS_PER_MESSAGE,
    MAX_VARIES_PER_MESSAGE,
    Demand,
    PackedRecord,
    Record,
    Sighting,
    Start,
    Withdrawal,
    decode_demand,
    decode_packed,
    decode_starts,
    decode_varies,
    decode_withdrawn,
    encode,
    encode_load,
    parse_message,
)
from gateway.tasks import cancel_and_wait

log = logging.getLogger("prefix_gateway.state")

_LOAD_HEARTBEAT_S = 1.0  # a load report goes out at least this often, changed or not
_SILENCE_PING_S = 15.0  # no message for this long: ping the server ...
_PONG_WAIT_S = 5.0  # ... and reconnect if nothing answers within this
_BACKOFF_START_S = 0.5
_BACKOFF_MAX_S = 10.0
# keys (or place rows) applied from a peer's message between two turns of the event loop: at
# ~1 us a key, a turn every few milliseconds however large the message
APPLY_CHUNK_KEYS = 4096


@dataclass
class SyncStats:
    """Counters for ``/metrics`` and ``/admin/stats`` (read at scrape time)."""

    connected: bool = False
    published: int = 0  # records sent to Redis
    applied: int = 0  # records from peers applied to a local index
    ignored: int = 0  # records from peers for a route or replica this process does not have
    dropped: int = 0  # local records never published (queue full, or Redis down)
    dropped_sightings: int = 0  # local starts and normalization places never published (a failed publish)
    oversize: int = 0  # peers' records refused for more keys than a max_body_bytes prompt can make
    errors: int = 0  # failed Redis calls and malformed messages
    rejected: int = 0  # messages dropped for a missing, wrong or stale signature (state.secret_env)
    replayed: int = 0  # signed messages refused as replays (a sequence already heard: state.secret_env)
    peers: int = 0  # other gateway processes whose load reports are current
    snapshots_heard: int = 0  # catch-up snapshots that ended (a peer's answer to a newcomer)
    starts_applied: int = 0  # peers' conversation starts behind shared heads, counted here too
    varies_applied: int = 0  # normalization places peers saw vary, learned here too
    withdrawn: int = 0  # withdrawals sent: records taken back here (the replica did not serve)
    withdrawals_applied: int = 0  # peers' withdrawals applied to a local index

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Inbound:
    """A peer's affinity message, decoded and validated, waiting to be applied."""

    records: list[PackedRecord]
    starts: list[Start]
    varies: list[Sighting]
    ends_snapshot: bool
    demand: Demand = field(default_factory=dict)
    #: withdrawals, each after the number of the message's records that precede it
    withdrawn: list[tuple[int, Withdrawal]] = field(default_factory=list)
    applied: int = 0


class RouteSink:
    """One route's seam into the sync: what its affinity index records, its head demand starts
    and its normalizer learns is queued for publishing under the route's name.

    Implements :class:`~gateway.routing.sinks.RecordSink`, :class:`~gateway.routing.sinks.StartSink`
    and :class:`~gateway.prefix.learn.LearnSink`; called on the request path, so it only queues.
    """

    __slots__ = ("_route", "_sync")

    def __init__(self, sync: AffinitySync, route: str) -> None:
        self._sync = sync
        self._route = route

    def recorded(self, replica: str, stored: list[int], prompt_tokens: int | None, weights: KeyWeights | None) -> None:
        # peers weigh the keys as this record did: the weights that are not the standard one
        explicit = weights.explicit(len(stored)) if weights else None
        self._sync._enqueue(self._route, replica, stored, prompt_tokens, explicit)

    def withdrawn(self, replica: str, keys: list[int]) -> None:
        self._sync._enqueue_withdrawal(self._route, replica, keys)

    def started(self, head: int) -> None:
        self._sync._enqueue_start(self._route, head)

    def learned(self, place: int, value: int) -> None:
        self._sync._enqueue_varies(self._route, place, value)


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
        # None: the end of a catch-up snapshot; withdrawals in the same queue keep their order
        self._pending: deque[Record | Withdrawal | None] = deque()
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
        # keys the normalization places' value digests on the channel (None without a secret)
        self.digest_key = signer.derive_key("value-digests") if signer is not None else None
        self._rejected_warned = False
        self.subscribed_at: float | None = None  # monotonic time of the first subscription
        self._subscribed = asyncio.Event()
        # route -> the most keys a record of it may hold (gateway.state.record_bounds), both ways:
        # larger local records stay local, larger peer records are refused (oversize)
        self.key_caps: dict[str, int] = {}
        self._attach()

    def _attach(self) -> None:
        """Become the sink of every shared index, start count and learner (one per route)."""
        for route, index in self._indexes.items():
            index.attach_sink(RouteSink(self, route))
        for route, demand in self._demands.items():
            demand.attach_sink(RouteSink(self, route))
        for route, learner in self._learners.items():
            learner.attach_sink(RouteSink(self, route), self.digest_key)

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
        """Give every shared object back its no-op sink: nothing more is published from them."""
        for index in self._indexes.values():
            index.attach_sink(NO_SINK)
        for demand in self._demands.values():
            demand.attach_sink(NO_SINK)
        for learner in self._learners.values():
            learner.attach_sink(NO_LEARN_SINK)

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
        if len(stored) > self.key_caps.get(route, MAX_KEYS_PER_RECORD):  # peers would refuse it: keep it local
            self.stats.dropped += 1
            return
        self._push(self._pending, Record(route, replica, stored, prompt_tokens, weights))

    def _enqueue_withdrawal(self, route: str, replica: str, keys: list[int]) -> None:
        if len(keys) <= MAX_KEYS_PER_RECORD:  # more: its record was never published either
            self._push(self._pending, Withdrawal(route, replica, keys))

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
        """Apply one pub/sub payload from a peer at once; returns the records applied (never raises).

        For tools and tests: the subscriber uses :meth:`receive`, which yields to the event
        loop while it applies a large message.
        """
        inbound = self._inbound(payload)
        if inbound is None:
            return 0
        for _ in self._apply_steps(inbound):
            pass
        return inbound.applied

    async def receive(self, payload: bytes | str) -> int:
        """:meth:`apply`, giving the event loop a turn after every ``APPLY_CHUNK_KEYS`` keys.

        A peer's message may hold ~780k keys (8 MiB): applied in one go it would hold every
        request of this process for about a second.
        """
        inbound = self._inbound(payload)
        if inbound is None:
            return 0
        for _ in self._apply_steps(inbound, APPLY_CHUNK_KEYS):
            await asyncio.sleep(0)
        return inbound.applied

    def _open(self, payload: bytes | str) -> bytes | str | None:
        """The payload inside a valid signed envelope (or as is without a secret); None if refused (counted)."""
        if self.signer is None:
            return payload
        opened, verdict = self.signer.verify(payload)
        if opened is not None:
            return opened
        if verdict == "replayed":
            self.stats.replayed += 1
            return None
        self.stats.rejected += 1
        if not self._rejected_warned:  # once: a flood of forgeries must not flood the log
            self._rejected_warned = True
            log.warning("affinity sync: dropped an unsigned or badly signed message on %s", self.channel)
        return None

    def _inbound(self, payload: bytes | str) -> _Inbound | None:
        """A peer's message decoded and validated, load reports applied; None when nothing more to apply."""
        opened = self._open(payload)
        if opened is None:
            return None
        try:
            message = parse_message(opened)
            pod = message["pod"]
            if pod == self.pod_id:
                return None
            if "load" in message:
                if self.peer_load is not None:
                    self.peer_load.apply(pod, parse_load(message["load"]), time.monotonic())
                return None
            records = decode_packed(message)
            withdrawn = decode_withdrawn(message, len(records))
            starts = decode_starts(message)
            varies = decode_varies(message)
            ends_snapshot = message.get("catch_up_end") is True
            demand = decode_demand(message) if ends_snapshot else {}
        except Exception as exc:  # ValueError, or anything a hostile payload finds
            self.stats.errors += 1
            log.warning("affinity sync: skipped a malformed message on %s: %s", self.channel, exc)
            return None
        return _Inbound(records, starts, varies, ends_snapshot, demand, withdrawn)

    def _apply_steps(self, inbound: _Inbound, pause: int = 0) -> Iterator[None]:
        """Apply ``inbound``, pausing (one ``yield``) after every ``APPLY_CHUNK_KEYS`` keys or rows
        (inside a large record too, with ``pause``: the keys unpacked one record at a time).

        A record with more keys than its route's ``key_caps`` (what one ``max_body_bytes``
        prompt can produce, :func:`gateway.state.record_bounds.max_record_keys`) is refused
        and counted in ``oversize``: no prompt of this fleet makes one.
        """
        done = 0
        taken_back = iter(inbound.withdrawn)
        following = next(taken_back, None)
        for position, packed in enumerate(inbound.records):
            following = self._withdraw_until(position, following, taken_back)
            index = self._indexes.get(packed.route)
            if index is None or not index.knows(packed.replica):
                self.stats.ignored += 1
                continue
            if packed.key_count > self.key_caps.get(packed.route, MAX_KEYS_PER_RECORD):
                self.stats.oversize += 1
                continue
            record = packed.unpack()
            weights = KeyWeights.of(record.weights)
            yield from index.record_stored_steps(record.replica, record.keys, record.prompt_tokens, weights, pause)
            inbound.applied += 1
            self.stats.applied += 1
            done += len(record.keys) % APPLY_CHUNK_KEYS if pause else len(record.keys)
            if done >= APPLY_CHUNK_KEYS:
                done = 0
                yield
        self._withdraw_until(len(inbound.records), following, taken_back)
        for route, head in inbound.starts:
            head_demand = self._demands.get(route)
            if head_demand is not None:
                head_demand.record_peer(head)
                self.stats.starts_applied += 1
        for i, (route, place, value) in enumerate(inbound.varies, 1):
            learner = self._learners.get(route)
            if learner is not None:
                learner.learn_peer(place, value)
                self.stats.varies_applied += 1
            if i % APPLY_CHUNK_KEYS == 0:
                yield
        if inbound.ends_snapshot:
            if not self.stats.snapshots_heard:  # a newcomer's first: the fleet's counts (one peer's suffice)
                for route, (total, heads) in inbound.demand.items():
                    if route in self._demands:
                        self._demands[route].merge(total, heads)
            self.stats.snapshots_heard += 1

    def _withdraw_until(
        self,
        position: int,
        following: tuple[int, Withdrawal] | None,
        rest: Iterator[tuple[int, Withdrawal]],
    ) -> tuple[int, Withdrawal] | None:
        """Apply the withdrawals due before the message's record at ``position`` (in order);
        returns the first one not due yet."""
        while following is not None and following[0] <= position:
            route, replica, keys = following[1]
            index = self._indexes.get(route)
            if index is not None and index.knows(replica):
                index.withdraw(replica, keys)
                self.stats.withdrawals_applied += 1
            following = next(rest, None)
        return following

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect lazily in the background: a Redis outage must not stop the gateway starting."""
        from gateway.state.redis_client import open_redis  # imported here: a memory-only gateway never loads redis

        self._attach()
        # timeouts (and keepalive, in open_redis): a silently dropped path to Redis must fail calls, not hang them
        self._redis = open_redis(self.redis_url, connect_timeout_s=2.0, timeout_s=5.0)
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
                            await self.receive(message["data"])
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
                batch, withdrawn, ends_snapshot = self._next_batch()
                starts = [self._starts.popleft() for _ in range(min(len(self._starts), MAX_RECORDS_PER_MESSAGE))]
                # a snapshot's end carries every place queued before it (they precede "ready")
                varies = [self._varies.popleft() for _ in range(min(len(self._varies), MAX_VARIES_PER_MESSAGE))]
                demand = None
                if ends_snapshot:
                    demand, self._snapshot_demand = self._snapshot_demand, None
                try:
                    payload = encode(
                        self.pod_id,
                        batch,
                        starts=starts,
                        varies=varies,
                        catch_up_end=ends_snapshot,
                        demand=demand,
                        withdrawn=withdrawn,
                    )
                    await self._redis.publish(self.channel, self._seal(payload))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.stats.errors += 1
                    self._lost(batch, withdrawn, len(starts) + len(varies), demand, ends_snapshot)
                    if not self._publish_failing:
                        log.warning("affinity sync: cannot publish to Redis (%s); dropping records meanwhile", exc)
                        self._publish_failing = True
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    self._wake.set()  # a snapshot's end waits in the queue: retry without waiting for traffic
                    break
                self.stats.published += len(batch)
                self.stats.withdrawn += len(withdrawn)
                self._publish_failing = False
                backoff = _BACKOFF_START_S

    def _lost(
        self,
        batch: list[Record],
        withdrawn: list[tuple[int, Withdrawal]],
        sightings: int,
        demand: Demand | None,
        ended: bool,
    ) -> None:
        """A publish failed: count what it and the queue held, and keep a catch-up's end.

        Affinity is a hint: records (and starts, places) made while Redis is away are dropped,
        not replayed, and counted.  A snapshot's end is different: a newcomer answers ``/ready``
        503 until it hears one, so it is queued again (without the snapshot's records) and goes
        out once Redis takes it.
        """
        ended = ended or any(record is None for record in self._pending)
        self.stats.dropped += len(batch) + len(withdrawn)
        self.stats.dropped += sum(1 for item in self._pending if item is not None)
        self.stats.dropped_sightings += sightings
        self._pending.clear()
        if ended:
            if self._snapshot_demand is None:
                self._snapshot_demand = demand
            self._pending.append(None)

    def _next_batch(self) -> tuple[list[Record], list[tuple[int, Withdrawal]], bool]:
        """Up to ``MAX_RECORDS_PER_MESSAGE`` pending records and withdrawals (each withdrawal
        with the number of the batch's records before it), stopping after a snapshot's end."""
        batch: list[Record] = []
        withdrawn: list[tuple[int, Withdrawal]] = []
        while self._pending and len(batch) + len(withdrawn) < MAX_RECORDS_PER_MESSAGE:
            item = self._pending.popleft()
            if item is None:
                return batch, withdrawn, True
            if isinstance(item, Withdrawal):
                withdrawn.append((len(batch), item))
            else:
                batch.append(item)
        return batch, withdrawn, False

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
