"""vLLM's KV cache events, built from what the simulated KV cache really does.

vLLM 0.32 (``vllm/distributed/kv_events.py``, ``vllm/v1/core/block_pool.py``) queues one
event per cache change during a scheduler step and publishes the step's events as one
batch ``[ts, [event, ...], data_parallel_rank]`` with a sequence number that grows by one
per published batch and starts at 0 with the process.  The simulator does the same so the
gateway's consumer meets the real wire format against simulated replicas:

- ``BlockStored`` when blocks become full and computed (also a *second* copy of a block
  that is already cached: the last full block of a repeated prompt is recomputed, because
  a hit must leave at least one token to compute, and vLLM stores and announces it again);
- ``BlockRemoved`` (one hash per event, as vLLM sends them) when a cached block is evicted;
- ``AllBlocksCleared`` on ``POST /reset_prefix_cache``.

Events are the structures a msgpack decoder yields for vLLM's msgspec encoding: maps with a
``"type"`` key in field order (``layout="map"``, 0.32's default) or the older positional
arrays with the tag first (``layout="array"``, vLLM before PR #42892).  Fields whose value is
their declared default are left out as msgspec's ``omit_defaults`` does (``lora_id``,
``medium`` and ``lora_name`` have no default, so they are always sent).  Hashes are the low
64 bits of the digest as unsigned integers (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the
default) or 32 raw digest bytes.

The sim's block hashes (:mod:`gateway.sim.hashing`) are its own, never the gateway's keys,
so a consumer must recompute its keys from ``token_ids`` as it must with a real engine.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgpack
from pydantic import BaseModel, ConfigDict, Field, field_validator

MEDIUM_GPU = "GPU"  # vLLM says "GPU" for its primary KV cache, also on the CPU backend
GROUP_IDX = 0  # one full-attention KV cache group
KV_CACHE_SPEC_KIND = "full_attention"  # what vLLM 0.32 sends for a plain decoder's group
_MASK64 = (1 << 64) - 1

Layout = Literal["map", "array"]


class KVEventsConfig(BaseModel):
    """vLLM's ``--kv-events-config`` keys and defaults (``vllm/config/kv_events.py``).

    ``endpoint`` with ``*`` (or ``::``, ``ipc://``, ``inproc://``) binds, any other
    ``tcp://host:port`` connects to a collector that binds.  Port 0 binds a free port,
    reported by ``GET /kv_event_sources`` (vLLM needs a node IP for that; the sim keeps ``*``).
    ``max_queue_size`` is accepted and reported but bounds nothing: the sim sends each batch
    from the engine's thread, so only the PUB's ``hwm`` can drop.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(10_000, ge=1)
    hwm: int = Field(100_000, ge=0)
    max_queue_size: int = Field(100_000, ge=1)
    topic: str = ""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError("must be a ZMQ endpoint such as tcp://*:5557")
        return value

    @property
    def resolved_publisher(self) -> str:
        """vLLM's rule: unset means "zmq" when events are enabled, else "null"."""
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    def source(self, endpoint: str | None = None, replay_endpoint: str | None = None) -> dict[str, Any]:
        """The ``/kv_event_sources`` entry: the resolved config in vLLM's field order."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint or self.endpoint,
            "replay_endpoint": replay_endpoint if replay_endpoint is not None else self.replay_endpoint,
            "buffer_steps": self.buffer_steps,
            "hwm": self.hwm,
            "max_queue_size": self.max_queue_size,
            "topic": self.topic,
        }


def parse_kv_events_config(value: Any) -> KVEventsConfig | None:
    """``--kv-events-config`` as given: a JSON string, a mapping, a config or None."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
        if value is None:
            return None
    return KVEventsConfig.model_validate(value)


def offset_endpoint_port(endpoint: str | None, offset: int) -> str | None:
    """vLLM's rule for data-parallel rank ``offset``: a tcp port + offset (port 0 stays 0)."""
    if not endpoint or offset == 0 or not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        return endpoint
    base, port = endpoint.rsplit(":", 1)
    return endpoint if int(port) == 0 else f"{base}:{int(port) + offset}"


def for_replica(config: KVEventsConfig | None, index: int) -> KVEventsConfig | None:
    """One config for N replicas of one command line: replica ``index`` offsets its ports."""
    if config is None or index == 0:
        return config
    return config.model_copy(
        update={
            "endpoint": offset_endpoint_port(config.endpoint, index),
            "replay_endpoint": offset_endpoint_port(config.replay_endpoint, index),
        }
    )


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's ``ZmqEventPublisher._is_bind_endpoint``."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def digest_bytes(key: int) -> bytes:
    """A 32-byte "raw digest" for a sim block key whose low 64 bits (big-endian) are the key.

    So the same block has the same identity in both hash modes, as in vLLM where the integer
    form is ``int.from_bytes(digest, "big") & (2**64 - 1)``.
    """
    tail = key.to_bytes(8, "big")
    return hashlib.blake2b(tail, digest_size=24).digest() + tail


def to_int_hash(external: int | bytes) -> int:
    """The integer form of either hash mode (for tests and in-process consumers)."""
    if isinstance(external, bytes):
        return int.from_bytes(external, "big") & _MASK64
    return external


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch: ``seq`` (the second ZMQ frame) and the decoded payload."""

    seq: int
    ts: float
    events: list[Any]
    data_parallel_rank: int = 0

    def payload(self) -> bytes:
        """The third ZMQ frame, byte for byte what msgspec encodes for vLLM's ``KVEventBatch``."""
        return msgpack.packb([self.ts, self.events, self.data_parallel_rank], use_bin_type=True)


BatchCallback = Callable[[EventBatch], None]


class Publisher(Protocol):
    """Where batches go on the wire (:class:`gateway.sim.kvpublisher.ZmqKVPublisher`)."""

    def publish(self, batch: EventBatch) -> None: ...

    def restart(self) -> None: ...


class KVEventRecorder:
    """Collects one step's events and hands each non-empty batch to its sinks.

    The engine calls :meth:`stored` / :meth:`removed` / :meth:`cleared` while it changes its
    cache and :meth:`flush` at the end of each step (vLLM's scheduler publishes there).
    Sinks: the ZMQ publisher and any in-process callbacks (the virtual-clock benchmark and
    tests get the very batches the wire carries, without sockets).  Nothing is built while
    there is no sink, so a replica without events pays one attribute check per change.
    """

    def __init__(
        self,
        block_size: int,
        *,
        int_hashes: bool = True,
        layout: Layout = "map",
        data_parallel_rank: int = 0,
    ) -> None:
        self.block_size = block_size
        self.int_hashes = int_hashes
        self.layout: Layout = layout
        self.data_parallel_rank = data_parallel_rank
        self.next_seq = 0
        self.pending: list[Any] = []
        self._sinks: list[BatchCallback] = []
        self.publisher: Publisher | None = None
        self.active = False  # True while anyone listens: the engine checks this before building

    # -- sinks -----------------------------------------------------------------------------
    def attach(self, publisher: Publisher | None) -> None:
        """The wire publisher (ZMQ), or None to stop publishing."""
        self.publisher = publisher
        self._update()

    def subscribe(self, callback: BatchCallback) -> Callable[[], None]:
        """Call ``callback(batch)`` for every batch from now on; returns the unsubscribe."""
        self._sinks.append(callback)
        self._update()

        def unsubscribe() -> None:
            if callback in self._sinks:
                self._sinks.remove(callback)
            self._update()

        return unsubscribe

    def _update(self) -> None:
        self.active = self.publisher is not None or bool(self._sinks)
        if not self.active:
            self.pending = []

    # -- events ----------------------------------------------------------------------------
    def _hash(self, key: int) -> int | bytes:
        return key if self.int_hashes else digest_bytes(key)

    def stored(
        self,
        keys: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        lora_id: int | None = None,
        lora_name: str | None = None,
        extra_keys: list[Any] | None = None,
    ) -> None:
        """Full blocks ``keys`` became cached; ``token_ids`` are exactly their tokens."""
        h = self._hash
        fields: list[tuple[str, Any, bool]] = [
            ("block_hashes", [h(k) for k in keys], True),
            ("parent_block_hash", None if parent is None else h(parent), True),
            ("token_ids", list(token_ids), True),
            ("block_size", self.block_size, True),
            ("lora_id", lora_id, True),
            ("medium", MEDIUM_GPU, True),
            ("lora_name", lora_name, True),
            ("extra_keys", extra_keys, extra_keys is not None),
            ("group_idx", GROUP_IDX, True),
            ("kv_cache_spec_kind", KV_CACHE_SPEC_KIND, True),
        ]
        self.pending.append(self._event("BlockStored", fields))

    def removed(self, key: int) -> None:
        fields = [
            ("block_hashes", [self._hash(key)], True),
            ("medium", MEDIUM_GPU, True),
            ("group_idx", GROUP_IDX, True),
        ]
        self.pending.append(self._event("BlockRemoved", fields))

    def cleared(self) -> None:
        self.pending.append(self._event("AllBlocksCleared", []))

    def _event(self, tag: str, fields: list[tuple[str, Any, bool]]) -> Any:
        if self.layout == "map":
            event: dict[str, Any] = {"type": tag}
            for name, value, present in fields:
                if present:
                    event[name] = value
            return event
        # positional: every field up to the last one that differs from its default
        values = [value for _, value, _ in fields]
        while fields and not fields[-1][2]:
            fields = fields[:-1]
            values.pop()
        return [tag, *values]

    def flush(self) -> EventBatch | None:
        """End of a step: publish the pending events as one batch (none if there are none)."""
        if not self.pending:
            return None
        batch = EventBatch(self.next_seq, time.time(), self.pending, self.data_parallel_rank)
        self.next_seq += 1
        self.pending = []
        if self.publisher is not None:
            self.publisher.publish(batch)
        for sink in list(self._sinks):
            sink(batch)
        return batch

    def restart(self) -> None:
        """A process restart: the sequence starts at 0 again and nothing queued survives."""
        self.pending = []
        self.next_seq = 0
        if self.publisher is not None:
            self.publisher.restart()


def extra_keys_for(num_blocks: int, first_block: int, lora_name: str | None, cache_salt: str | None) -> list[Any]:
    """vLLM's per-block ``extra_keys`` as events publish them (untagged, one entry per block).

    Each block carries the LoRA name when a LoRA serves the request; the first block of the
    sequence also carries ``cache_salt``.  A block with neither is ``None``.
    """
    out: list[Any] = []
    for i in range(first_block, first_block + num_blocks):
        keys: list[Any] = []
        if lora_name:
            keys.append(lora_name)
        if i == 0 and cache_salt:
            keys.append(cache_salt)
        out.append(keys or None)
    return out
