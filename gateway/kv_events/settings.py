"""The ``kv_events:`` config section: precise routing from the engines' KV cache events.

Top level, not per route: events describe a replica's cache whichever routes send to it,
so one subscription and one index per replica serve every route (each route still matches
only when its block size equals the replica's, see :mod:`gateway.kv_events.routing`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator


def _zmq_endpoint(value: str) -> str:
    if not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"a ZMQ endpoint starts with tcp://, ipc:// or inproc:// (got {value!r})")
    if value.startswith("tcp://") and ":" not in value[6:]:
        raise ValueError(f"a tcp:// endpoint needs a port (got {value!r})")
    return value


class KvEndpoint(BaseModel):
    """Where one replica (one data-parallel rank) publishes, when not discovered."""

    model_config = {"extra": "forbid"}

    endpoint: str = Field(description="the engine's PUB, e.g. tcp://10.0.0.5:5557 (`*` is read as the replica's host)")
    replay_endpoint: str | None = Field(None, description="its ROUTER for replays (tcp://HOST:5558), if it has one")
    dp_rank: int = Field(0, ge=0, le=1024, description="the data-parallel rank publishing there")

    @field_validator("endpoint")
    @classmethod
    def _endpoint_ok(cls, value: str) -> str:
        return _zmq_endpoint(value)

    @field_validator("replay_endpoint")
    @classmethod
    def _replay_ok(cls, value: str | None) -> str | None:
        return None if value is None else _zmq_endpoint(value)


class KvEventsSettings(BaseModel):
    """Precise prefix routing from vLLM's KV cache events (``--kv-events-config``)."""

    model_config = {"extra": "forbid"}

    enabled: Literal["auto", True, False] = Field(
        "auto",
        description="auto: subscribe to every replica that publishes events (found by GET /kv_event_sources or "
        "listed in endpoints) and route those precisely, the rest by the approximate model; true: the same, and a "
        "replica without events is a warning in the doctor; false: never subscribe (approximate model only)",
    )
    discover: bool = Field(
        True,
        description="find each replica's publisher by GET /kv_event_sources on the replica (vLLM 0.32 serves it); "
        "a tcp://*:PORT endpoint is read as the replica's own host",
    )
    fallback_endpoint: str | None = Field(
        None,
        description="where a replica whose /kv_event_sources is missing publishes, e.g. tcp://*:5557 (`*`: the "
        "replica's host): for discovered fleets of older vLLMs started with the same --kv-events-config",
    )
    fallback_replay_endpoint: str | None = Field(
        None, description="the replay endpoint that goes with fallback_endpoint, e.g. tcp://*:5558"
    )
    endpoints: dict[str, list[KvEndpoint]] = Field(
        default_factory=dict,
        description="replica name -> its publishers (one per data-parallel rank); overrides discovery for it",
    )
    collector_bind: str | None = Field(
        None,
        description="also bind a SUB here (e.g. tcp://*:5557) for engines configured to connect to the gateway "
        "(endpoint tcp://GATEWAY:5557); such an engine's `topic` must be its replica name",
    )
    stale_s: float = Field(
        20.0,
        gt=0,
        description="a replica that was sent a request storing new blocks and published nothing for this long is "
        "routed by the approximate model until its events resume (vLLM sends no heartbeat)",
    )
    speculative_s: float = Field(
        10.0,
        ge=0,
        description="how long a routing choice counts as held before the engine's events confirm it (a burst with "
        "a new prefix, a conversation's quick next turn), and with project_evictions for as long as its request is in "
        "flight there (at saturation a request can wait longer in the engine's queue); 0: only what the engine "
        "reported",
    )
    project_evictions: bool = Field(
        True,
        description="predicted cached tokens leave out the blocks the prefill queued ahead of the request on that "
        "replica will evict first (the engine's LRU projected from its events and the gateway's own choices), "
        "where the affinity model agrees; routing still ranks by the engine's word. On the policy benchmark it is "
        "at or above plain precise on every cell (Mooncake conversation saturated: error 1.38 -> 0.52 %, hit +1.09 "
        "points over the approximate model against +0.44) for ~30-40 us per decision and ~100 bytes per indexed "
        "block (benchmarks/README.md); false: the engine's word as it is now",
    )
    max_bytes: int = Field(
        128 * 1024 * 1024,
        ge=64 * 1024,
        description="memory bound of the precise index, all replicas together (~400 bytes per indexed key, 500 "
        "with project_evictions: one key per engine block, or engine/route keys where an engine's block size is a "
        "multiple of its route's); over it the replica with most keys forgets its oldest blocks",
    )
    max_depth_tokens: int | None = Field(
        None,
        ge=16,
        description="index blocks up to this many tokens deep (null: the largest prefix.window_tokens of the "
        "routes; deeper blocks are never asked for, requests key text past their window)",
    )
    rediscover_s: float = Field(
        30.0, gt=0, description="ask a silent or unreachable replica's /kv_event_sources again this often"
    )
    replay_timeout_s: float = Field(
        2.0, gt=0, description="how long a gap's replay may take before the replica's entries are dropped instead"
    )
    max_message_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="larger ZMQ messages are refused by the socket (never allocated)"
    )

    @field_validator("collector_bind", "fallback_endpoint", "fallback_replay_endpoint")
    @classmethod
    def _bind_ok(cls, value: str | None) -> str | None:
        return None if value is None else _zmq_endpoint(value)
