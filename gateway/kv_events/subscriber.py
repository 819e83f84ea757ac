"""ZMQ subscriptions: one SUB per replica (connected to each of its ranks' publishers), an
optional bound collector, and replays over DEALER sockets.

Each replica's subscription is a task of its own: it resolves where the replica publishes
(``resolve``, from config or ``/kv_event_sources``), connects, and feeds every message to
the :class:`~gateway.kv_events.ingest.Ingestor` in order.  ZMQ reconnects by itself, so a
replica killed and restarted at the same address comes back without anything done here
(its sequence starts again at 0: a restart, its entries are cleared); a replica silent for
``rediscover_s`` is resolved again, and reconnected if its publishers moved.

So is the first message after (re)connecting when the engine already published before it
(from sequence 0: what its replay buffer still holds).  A gap is replayed when the rank has a
replay endpoint: a DEALER sends ``[b"", start]`` and
reads ``[b"", topic, seq, payload]`` until the end marker (seq ``0xFF`` x 8); the replayed
batches are applied in order, then the message that revealed the gap.  If the replay does
not close the gap in ``replay_timeout_s``, the replica's entries are dropped and relearned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.kv_events.decoder import Batch, Dropped, decode_frames, decode_payload
from gateway.kv_events.ingest import Ingestor
from gateway.kv_events.settings import KvEventsSettings
from gateway.kv_events.sources import Source

log = logging.getLogger("prefix_gateway.kv_events")

END_SEQ = b"\xff" * 8
CATCH_UP_AFTER_S = 1.0  # a fresh stream quiet this long asks its replay buffer (see catch_up)
Resolver = Callable[[], Awaitable[tuple[list[Source], str | None]]]


def _sub_socket(ctx: zmq.asyncio.Context, settings: KvEventsSettings) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, settings.max_message_bytes)  # refused by ZMQ, never allocated
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    return sock


class Subscription:
    """One replica's feed over ZMQ."""

    def __init__(
        self,
        name: str,
        ctx: zmq.asyncio.Context,
        ingestor: Ingestor,
        settings: KvEventsSettings,
        resolve: Resolver,
        source: str,
    ) -> None:
        self.name = name
        self.ctx = ctx
        self.ingestor = ingestor
        self.settings = settings
        self.resolve = resolve
        self.source = source
        self.sources: list[Source] = []
        self._replay_of: dict[int, str] = {}
        self._fresh_until = 0.0  # (re)connected or disconnected lately: catch up while quiet until then

    async def run(self) -> None:
        feed = self.ingestor.feed(self.name)
        feed.source = self.source
        while True:
            sources, error = await self.resolve()
            feed.error = error
            if not sources:
                feed.subscribed = False
                feed.endpoints, feed.replay_endpoints = [], []
                await asyncio.sleep(self.settings.rediscover_s)
                continue
            await self._serve(sources)

    async def _serve(self, sources: list[Source]) -> None:
        feed = self.ingestor.feed(self.name)
        self.sources = sources
        self._replay_of = {s.dp_rank: s.replay_endpoint for s in sources if s.replay_endpoint}
        sock = _sub_socket(self.ctx, self.settings)
        watch = asyncio.create_task(self._watch_disconnects(sock), name=f"kv-monitor-{self.name}")
        try:
            for source in sources:
                sock.connect(source.endpoint)
            feed.subscribed = True
            feed.resubscribed()
            self.ingestor.modes_epoch += 1
            feed.endpoints = [s.endpoint for s in sources]
            feed.replay_endpoints = [s.replay_endpoint for s in sources if s.replay_endpoint]
            log.info("kv events: %s subscribed to %s", self.name, ", ".join(feed.endpoints))
            loop = asyncio.get_running_loop()
            silent_since = loop.time()
            self._fresh_until = loop.time() + self.settings.rediscover_s
            while True:
                if await sock.poll(int(CATCH_UP_AFTER_S * 1000)):
                    await self.handle(await sock.recv_multipart(copy=True))
                    silent_since = loop.time()
                    continue
                if loop.time() < self._fresh_until:
                    await self.catch_up()
                if loop.time() - silent_since < self.settings.rediscover_s:
                    continue
                silent_since = loop.time()
                again, error = await self.resolve()  # silent: did its publishers move?
                if again and again != sources:
                    log.info("kv events: %s publishers moved; reconnecting", self.name)
                    return
                feed.error = error
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            sock.disable_monitor()
            sock.close(0)

    async def _watch_disconnects(self, sock: zmq.asyncio.Socket) -> None:
        """A publisher's connection dropping means its engine process ended (or the network
        did): what it held is not to be trusted — cleared at once, not when (if ever) the
        restarted engine publishes again (an idle engine publishes nothing)."""
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                frames = await monitor.recv_multipart()
                if parse_monitor_message(frames)["event"] != zmq.EVENT_DISCONNECTED:
                    continue
                feed = self.ingestor.feed(self.name)
                # the engine that comes back may publish before this SUB reconnects: catch up
                self._fresh_until = asyncio.get_running_loop().time() + self.settings.rediscover_s
                feed.disconnects += 1
                feed.fresh_since = time.monotonic()
                self.ingestor.new_stream(self.name)  # a new engine numbers from 0: its stream starts afresh
                log.info("kv events: %s publisher disconnected; its entries are cleared", self.name)
        finally:
            monitor.close(0)

    async def catch_up(self) -> None:
        """A fresh stream gone quiet: fetch what each rank's replay buffer holds (an engine
        restarted, or started, and published its first batches before this SUB was connected:
        ZMQ drops what a PUB sends while nobody is connected).  Tried each quiet second for
        ``rediscover_s`` after a (re)connection or a disconnect, until a rank is heard."""
        feed = self.ingestor.feed(self.name)
        pending = [(rank, endpoint) for rank, endpoint in self._replay_of.items() if rank not in feed.last_seq]
        if not pending:
            self._fresh_until = 0.0  # every rank is followed live
            return
        for rank, endpoint in pending:
            if await self.replay(endpoint, rank, 0, None):
                feed.replays["ok"] += 1

    async def handle(self, frames: list[bytes]) -> None:
        """One message: decode, check its sequence, replay a gap if possible, apply."""
        feed = self.ingestor.feed(self.name)
        try:
            batch = decode_frames(frames)
        except Dropped as dropped:
            feed.dropped[dropped.reason] += 1
            return
        replay = self._replay_of.get(batch.dp_rank)
        if replay and batch.seq > 0 and feed.check(batch.dp_rank, batch.seq) == "first":
            # the first message since (re)connecting, and the engine published before it (a
            # gateway joining a running engine, or a restarted engine quicker than ZMQ's
            # reconnect): fetch what its replay buffer still holds first
            caught_up = await self.replay(replay, batch.dp_rank, 0, batch.seq)
            feed.replays["ok" if caught_up else "failed"] += 1
        verdict = self.ingestor.ingest(
            self.name, batch.dp_rank, batch.seq, batch.events, on_gap="report" if replay else "clear"
        )
        if verdict != "gap" or not replay:
            return  # in order, or a gap already handled by dropping the replica's entries
        start = feed.last_seq[batch.dp_rank] + 1
        if await self.replay(replay, batch.dp_rank, start, batch.seq):
            feed.replays["ok"] += 1
            feed.gaps += 1
            self.ingestor.ingest(self.name, batch.dp_rank, batch.seq, batch.events)
        else:
            feed.replays["failed"] += 1
            self.ingestor.resync(self.name, batch.dp_rank, batch.seq, batch.events)

    async def replay(self, endpoint: str, rank: int, start: int, until: int | None) -> bool:
        """Fetch and apply batches ``start .. until - 1`` (None: all it holds); True when the
        gap is closed (None: when anything was applied)."""
        feed = self.ingestor.feed(self.name)
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes)
        try:
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.settings.replay_timeout_s
            while True:
                left = deadline - loop.time()
                if left <= 0 or not await dealer.poll(int(left * 1000) + 1):
                    return False
                frames = await dealer.recv_multipart(copy=True)
                if len(frames) != 4 or frames[0] != b"":
                    feed.dropped["frames"] += 1
                    continue
                _, topic, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    if until is None:
                        return rank in feed.last_seq
                    return feed.last_seq.get(rank) == until - 1
                if len(seq_bytes) != 8:
                    feed.dropped["sequence"] += 1
                    continue
                seq = int.from_bytes(seq_bytes, "big")
                if seq < start or (until is not None and seq >= until):
                    continue
                try:
                    batch = decode_payload(topic, seq, payload)
                except Dropped as dropped:
                    feed.dropped[dropped.reason] += 1
                    return False
                if feed.check(rank, seq) not in ("next", "first"):
                    return False  # the replay buffer no longer holds the start of the gap
                self.ingestor.ingest(self.name, rank, seq, batch.events)
        except zmq.ZMQError as exc:
            log.warning("kv events: replay from %s for %s failed: %s", endpoint, self.name, exc)
            return False
        finally:
            dealer.close(0)


class Collector:
    """A bound SUB for engines that connect to the gateway; the topic names the replica."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        ingestor: Ingestor,
        settings: KvEventsSettings,
        known: Callable[[str], bool],
    ) -> None:
        self.ctx = ctx
        self.ingestor = ingestor
        self.settings = settings
        self.known = known
        self.unknown_topic = 0
        self.bound: str | None = None

    async def run(self) -> None:
        bind = self.settings.collector_bind
        assert bind is not None
        sock = _sub_socket(self.ctx, self.settings)
        try:
            sock.bind(bind)
            self.bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            log.info("kv events: collector bound on %s", self.bound)
            while True:
                frames = await sock.recv_multipart(copy=True)
                self.handle(frames)
        finally:
            sock.close(0)

    def handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        name = frames[0].decode("utf-8", "replace")
        if not self.known(name):
            self.unknown_topic += 1
            return
        feed = self.ingestor.feed(name)
        feed.subscribed = True
        feed.source = "collector"
        try:
            batch: Batch = decode_frames(frames)
        except Dropped as dropped:
            feed.dropped[dropped.reason] += 1
            return
        self.ingestor.ingest(name, batch.dp_rank, batch.seq, batch.events)
