"""The ZMQ side of the sim's KV events, shaped like vLLM's ``ZmqEventPublisher``.

- a PUB socket sends three frames per batch: topic, the sequence as 8 bytes big-endian,
  the msgpack payload; it binds (``tcp://*:PORT``) or connects to a collector
  (``tcp://host:PORT``), and drops silently over its high-water mark, as vLLM's does;
- an optional ROUTER on ``replay_endpoint`` answers ``[b"", start_seq]`` (from a DEALER)
  with ``[b"", topic, seq, payload]`` for every buffered batch from ``start_seq`` on (the
  last ``buffer_steps`` batches), then the end frame ``[b"", b"", 0xFF * 8, b""]``.

A ZMQ socket must be used by one thread at a time: the engine's thread owns the PUB (a send
never blocks: over the high-water mark ZMQ drops) and appends each batch to the replay
buffer; a background thread owns the ROUTER and answers replays from a copy of the buffer
taken under a lock, so a replay never slows the engine.  (Handing every batch to a
publisher thread, as vLLM does, cost ~140 µs per batch in GIL hand-offs here.)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections import deque

import zmq

from gateway.sim.kvevents import EventBatch, KVEventsConfig, is_bind_endpoint

logger = logging.getLogger("gateway.sim.kvevents")

END_SEQ = b"\xff" * 8  # (-1).to_bytes(8, "big", signed=True): the end of a replay
_ids = itertools.count()


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind and return the endpoint with the port really bound (port 0 = a free port)."""
    sock.bind(endpoint)
    if not endpoint.startswith("tcp://"):
        return endpoint
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    port = bound.rsplit(":", 1)[1]
    return endpoint.rsplit(":", 1)[0] + ":" + port


class ZmqKVPublisher:
    """PUB (the engine's thread) + ROUTER replay (a thread of its own)."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._ctx = zmq.Context()
        self._topic = config.topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()
        self.dropped = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if is_bind_endpoint(config.endpoint):
                self.endpoint = _bind(self._pub, config.endpoint)
            else:
                self._pub.connect(config.endpoint)
                self.endpoint = config.endpoint
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, config.replay_endpoint)
            address = f"inproc://sim-kv-events-stop-{next(_ids)}"
            self._stop_rx = self._ctx.socket(zmq.PAIR)
            self._stop_rx.bind(address)
            self._stop_tx = self._ctx.socket(zmq.PAIR)
            self._stop_tx.connect(address)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"cannot open the KV event sockets ({config.endpoint}): {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="sim-kv-events", daemon=True)
        self._thread.start()

    def source(self) -> dict[str, object]:
        """The ``/kv_event_sources`` entry with the endpoints as really bound."""
        return self.config.source(self.endpoint, self.replay_endpoint)

    # -- the engine's side -----------------------------------------------------------------
    def publish(self, batch: EventBatch) -> None:
        """Send one batch (dropped, and counted, when the PUB is over its high-water mark)."""
        payload = batch.payload()
        seq = batch.seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart((self._topic, seq, payload), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("KV event publisher over its high-water mark: dropping batches")
        with self._lock:
            self._buffer.append((batch.seq, payload))

    def restart(self) -> None:
        """A simulated process restart: the replay buffer is lost with the process."""
        with self._lock:
            self._buffer.clear()

    def close(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._stop_tx.send(b"")
            self._thread.join(timeout=2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for name in ("_stop_tx", "_stop_rx", "_replay", "_pub"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    # -- the replay thread -----------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._stop_rx, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                ready = dict(poller.poll())
                if ready.get(self._stop_rx):
                    return
                if self._replay is not None and ready.get(self._replay):
                    self._serve_replay()
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    return
                logger.exception("KV event replay error")

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:  # vLLM logs and ignores anything but [id, b"", start_seq]
                logger.warning("invalid KV event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                buffered = list(self._buffer)
            for seq, payload in buffered:
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
