"""The doctor's word on precise routing: which replicas are matched from their engines' KV
events and which by the gateway's model, and why (from ``/admin/stats``'s ``kv_events``).

A note always (one line per mode), and a finding for each route whose replicas fell back to
the approximate model while events are wanted: events that stopped (``stale``), never came
with ``kv_events.enabled: true``, or describe another block size than the route hashes.
"""

from __future__ import annotations

from typing import Any

from gateway.doctor.model import Finding, Fix

_HOW = {
    "no_events_yet": "subscribed, nothing received yet (an idle engine publishes nothing)",
    "not_subscribed": "no publisher found",
    "stale": "events stopped while it was served requests",
    "block_size_mismatch": "its events' block size is neither the route's prefix.block_size nor a multiple of it "
    "(or another route over it is keyed at its own size)",
    "disabled": "kv_events.enabled is false",
}


def _section(stats: dict[str, Any] | None) -> dict[str, Any]:
    section = (stats or {}).get("kv_events")
    return section if isinstance(section, dict) else {}


def kv_mode_notes(stats: dict[str, Any] | None) -> list[str]:
    """``kv events: precise on r0, r1; approximate on r2 (not_subscribed: ...)``, or nothing."""
    rows = _section(stats).get("replicas")
    if not isinstance(rows, dict) or not rows:
        return []
    precise = [
        name + _keyed_finer(row)
        for name, row in sorted(rows.items())
        if isinstance(row, dict) and row.get("mode") == "precise"
    ]
    approximate = []
    for name, row in sorted(rows.items()):
        if isinstance(row, dict) and row.get("mode") != "precise":
            error = f"; {row['error']}" if row.get("error") else ""
            approximate.append(f"{name} ({row.get('reason')}{error})")
    parts = []
    if precise:
        parts.append("precise (matched from KV events) on " + ", ".join(precise))
    if approximate:
        parts.append("approximate (the gateway's model) on " + ", ".join(approximate))
    return ["kv events: " + "; ".join(parts)]


def _keyed_finer(row: dict[str, Any]) -> str:
    """`` (keyed at 16 of its 128)`` for a replica whose engine blocks are indexed as several of
    its route's keys (``keyed_at`` below its ``block_size``), else nothing."""
    keyed, size = row.get("keyed_at"), row.get("block_size")
    if isinstance(keyed, int) and isinstance(size, int) and 0 < keyed < size:
        return f" (keyed at {keyed} of its {size})"
    return ""


def kv_fallbacks(route: str, live: dict[str, Any], stats: dict[str, Any] | None) -> list[Finding]:
    """A finding when some of ``route``'s replicas are approximate although events are wanted."""
    section = _section(stats)
    rows = section.get("replicas") if isinstance(section.get("replicas"), dict) else {}
    replicas = live.get("replicas") if isinstance(live.get("replicas"), dict) else {}
    wanted_everywhere = section.get("enabled") is True
    fallen: dict[str, str] = {}
    for name, row in replicas.items():
        if not isinstance(row, dict) or row.get("kv_mode") in (None, "precise"):
            continue
        reason = str((rows.get(name) or {}).get("reason") or "")
        if reason in ("stale", "block_size_mismatch") or (wanted_everywhere and reason != "disabled"):
            fallen[name] = reason
    if not fallen:
        return []
    evidence = [f"{name}: {_HOW.get(reason, reason)}" for name, reason in sorted(fallen.items())]
    errors = [f"{name}: {rows[name]['error']}" for name in sorted(fallen) if (rows.get(name) or {}).get("error")]
    return [
        Finding(
            "kv_events_fallback",
            route,
            f"{len(fallen)} replica(s) routed by the approximate model instead of their KV events",
            evidence + errors,
            Fix(
                summary='start vLLM with --kv-events-config \'{"enable_kv_cache_events": true, "publisher": '
                '"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' and open port '
                "5557 (and 5558) to the gateway; set prefix.block_size to the engine's (see docs/kv_events.md)",
            ),
            severity=0.5 if "stale" in fallen.values() else 0.3,
            data={"replicas": fallen},
        )
    ]
