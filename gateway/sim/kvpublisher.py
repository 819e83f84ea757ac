"""The ZMQ side of the sim's KV events, shaped like vLLM's ``ZmqEventPublisher``.

- a PUB socket sends three frames per batch: topic, the sequence as 8 bytes big-endian,
  the msgpack payload; it binds (``tcp://*:PORT``) or connects to a collector
  (``tcp://host:PORT``), and drops silently over its high-water mark, as vLLM's does;
- an optional ROUTER on ``replay_endpoint`` answers ``[b"", start_seq]`` (from a DEALER)
  with ``[b"", topic, seq, payload]`` for every buffered batch from ``start_seq`` on (the
  last ``buffer_steps`` batches), then the end frame ``[b"", b"", 0xFF * 8, b""]``.

ZMQ sockets must stay on one thread, and the engine runs on the event loop: one
background thread owns PUB and ROUTER and the loop hands it batches through an
``inproc`` PAIR, so a replay request is answered at once while the engine keeps running.
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
_PUBLISH, _RESET, _STOP = b"P", b"R", b"S"
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
    """PUB + ROUTER replay on a thread of their own.  :meth:`publish` is called from one thread."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._ctx = zmq.Context()
        self._topic = config.topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
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
            address = f"inproc://sim-kv-events-{next(_ids)}"
            self._inbox = self._ctx.socket(zmq.PAIR)
            self._inbox.set_hwm(config.max_queue_size)
            self._inbox.bind(address)
            self._outbox = self._ctx.socket(zmq.PAIR)
            self._outbox.set_hwm(config.max_queue_size)
            self._outbox.connect(address)
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
        """Queue one batch; over ``max_queue_size`` queued batches it is dropped (and counted)."""
        try:
            self._outbox.send_multipart((_PUBLISH, batch.seq.to_bytes(8, "big"), batch.payload()), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("KV event queue full: dropping batches (consumers are not keeping up)")

    def restart(self) -> None:
        """A simulated process restart: the replay buffer is lost with the process."""
        with contextlib.suppress(zmq.ZMQError):
            self._outbox.send(_RESET)

    def close(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._outbox.send(_STOP)
            self._thread.join(timeout=2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for name in ("_outbox", "_inbox", "_replay", "_pub"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    # -- the publisher thread --------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                ready = dict(poller.poll())
                if self._replay is not None and ready.get(self._replay):
                    self._serve_replay()
                if ready.get(self._inbox) and not self._drain_inbox():
                    return
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    return
                logger.exception("KV event publisher error")

    def _drain_inbox(self) -> bool:
        """Forward every queued batch; False once told to stop."""
        while True:
            try:
                frames = self._inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            kind = frames[0]
            if kind == _STOP:
                return False
            if kind == _RESET:
                self._buffer.clear()
                continue
            _, seq_bytes, payload = frames
            self._pub.send_multipart((self._topic, seq_bytes, payload))
            self._buffer.append((int.from_bytes(seq_bytes, "big"), payload))

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
            for seq, payload in self._buffer:
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
