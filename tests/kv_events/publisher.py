"""A small stand-in for vLLM's ZMQ event publisher, for tests (until the simulator publishes).

Same wire as vLLM 0.32 (NOTES §9): a PUB sending ``[topic, seq (8 bytes BE), payload]``, and
optionally a ROUTER on a replay endpoint answering ``[id, b"", start]`` with every buffered
``[id, b"", topic, seq, payload]`` from ``start`` on, then ``[id, b"", b"", 0xFF x 8, b""]``.
It runs on a thread of its own (like vLLM's publisher thread), so the gateway's asyncio
subscriber is tested against a real, independent peer.  ``skip`` sends a sequence number
without the message (a drop over the high-water mark); ``restart`` starts numbering at 0.
"""

from __future__ import annotations

import threading
from typing import Any

import zmq

from tests.kv_events.frames import payload


class TestPublisher:
    __test__ = False  # not a test class

    def __init__(
        self, replay: bool = True, topic: bytes = b"", connect: str | None = None, port: int | None = None
    ) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect is None:
            if port is None:
                port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            else:  # an engine restarted on its old port
                self.pub.bind(f"tcp://127.0.0.1:{port}")
            self.port = port
            self.endpoint = f"tcp://*:{port}"  # as /kv_event_sources shows a binding engine
        else:
            self.pub.connect(connect)
            self.endpoint = connect
        self.topic = topic
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_endpoint: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replays_served = 0
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://*:{rport}"
            self._thread = threading.Thread(target=self._serve_replays, daemon=True)
            self._thread.start()

    def publish(self, events: list[Any], dp_rank: int = 0, *, send: bool = True) -> int:
        """Publish one batch (``send=False``: numbered and buffered but lost on the way)."""
        with self._lock:
            seq = self.seq
            self.seq += 1
            body = payload(events, dp_rank)
            self.buffer.append((seq, body))
            if send:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), body])
        return seq

    def restart(self) -> None:
        """The engine restarted: numbering from 0 again, nothing to replay."""
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def _serve_replays(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                for seq, body in self.buffer:
                    if seq >= first:
                        self.router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), body])
                self.router.send_multipart([client, b"", b"", b"\xff" * 8, b""])
                self.replays_served += 1

    def sources(self, rank: int = 0) -> dict[str, Any]:
        """What vLLM's ``GET /kv_event_sources`` answers for this publisher."""
        return {
            str(rank): {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint,
                "topic": self.topic.decode(),
            }
        }

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        self.ctx.destroy(0)
