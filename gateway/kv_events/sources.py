"""Where a replica publishes its KV events, and which base model its events are keyed with.

vLLM answers ``GET /kv_event_sources`` with its resolved publisher config per data-parallel
rank (``{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557", "replay_endpoint": ..., "topic": ...}}``).  An endpoint that binds every
interface (``*``, ``0.0.0.0``, ``::``) is reachable at the replica's own host, the one in
its URL.  ``GET /v1/models`` names the base model (the entry without a ``parent``; LoRA
adapters name it as theirs), which seeds the first block's key (contract §2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.kv_events.settings import KvEndpoint
from gateway.replicas.pool import Replica
from gateway.upstream.errors import UpstreamError

_WILDCARDS = {"*", "0.0.0.0", "::", "[::]", ""}


@dataclass(frozen=True, slots=True)
class Source:
    """One rank's publisher as the gateway connects to it."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def connectable(endpoint: str, replica_url: str) -> str:
    """``endpoint`` with a wildcard host replaced by the replica's host (IPv6 bracketed)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint[6:]
    host, _, port = rest.rpartition(":")
    if host not in _WILDCARDS:
        return endpoint
    replica_host = urlsplit(replica_url).hostname or "127.0.0.1"
    if ":" in replica_host:
        replica_host = f"[{replica_host}]"
    return f"tcp://{replica_host}:{port}"


def parse_sources(data: Any, replica_url: str) -> list[Source]:
    """The ranks of a ``/kv_event_sources`` answer that publish over ZMQ (anything else is skipped)."""
    if not isinstance(data, dict):
        return []
    out: list[Source] = []
    for rank, config in data.items():
        try:
            dp_rank = int(rank)
        except (TypeError, ValueError):
            continue
        if not isinstance(config, dict) or config.get("enable_kv_cache_events") is False:
            continue
        if config.get("publisher", "zmq") != "zmq":
            continue
        endpoint = config.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            continue
        replay = config.get("replay_endpoint")
        topic = config.get("topic")
        out.append(
            Source(
                dp_rank,
                connectable(endpoint, replica_url),
                connectable(replay, replica_url) if isinstance(replay, str) and replay else None,
                topic if isinstance(topic, str) else "",
            )
        )
    return sorted(out, key=lambda source: source.dp_rank)


def configured_sources(endpoints: list[KvEndpoint], replica_url: str) -> list[Source]:
    return [
        Source(
            e.dp_rank,
            connectable(e.endpoint, replica_url),
            e.replay_endpoint and connectable(e.replay_endpoint, replica_url),
        )
        for e in endpoints
    ]


def base_model_of(entries: Any) -> str | None:
    """The ``/v1/models`` entry without a parent (vLLM lists LoRA adapters with ``parent``)."""
    data = entries.get("data") if isinstance(entries, dict) else None
    if not isinstance(data, list):
        return None
    for entry in data:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and not entry.get("parent"):
            return entry["id"]
    return None


async def _get_json(replica: Replica, path: str, timeout_s: float) -> tuple[int, Any]:
    headers = {"Authorization": replica.auth_header} if replica.auth_header else None
    status, body = await replica.client.get(path, timeout_s, headers)
    try:
        return status, json.loads(body) if status == 200 else None
    except ValueError:
        return status, None


async def discover(replica: Replica, timeout_s: float) -> tuple[list[Source], str | None]:
    """(its publishers, why none) from ``GET /kv_event_sources``."""
    try:
        status, data = await _get_json(replica, "/kv_event_sources", timeout_s)
    except UpstreamError as exc:
        return [], f"/kv_event_sources: {exc}"
    if status != 200:
        return [], f"/kv_event_sources: HTTP {status} (vLLM < 0.11, or not vLLM)"
    sources = parse_sources(data, replica.url)
    return sources, None if sources else "/kv_event_sources: no ZMQ publisher (start vLLM with --kv-events-config)"


async def base_model(replica: Replica, timeout_s: float) -> str | None:
    try:
        status, data = await _get_json(replica, "/v1/models", timeout_s)
    except UpstreamError:
        return None
    return base_model_of(data) if status == 200 else None
