"""The doctor names each replica's routing mode and flags replicas whose KV events stopped."""

from __future__ import annotations

from gateway.doctor.analyses import diagnose
from gateway.doctor.model import Corpus


def _stats(enabled: object = "auto") -> dict:
    return {
        "routes": {
            "main": {
                "requests": 50,
                "replicas": {
                    "r0": {"kv_mode": "precise"},
                    "r1": {"kv_mode": "approximate"},
                    "r2": {"kv_mode": "approximate"},
                },
            }
        },
        "kv_events": {
            "enabled": enabled,
            "replicas": {
                "r0": {"mode": "precise", "reason": None},
                "r1": {"mode": "approximate", "reason": "stale", "error": None},
                "r2": {"mode": "approximate", "reason": "not_subscribed", "error": "/kv_event_sources: HTTP 404"},
            },
        },
    }


def test_the_doctor_says_which_replicas_are_precise_and_flags_stopped_events() -> None:
    diagnosis = diagnose(Corpus(source="gateway", stats=_stats()))
    assert any(
        note.startswith("kv events: precise (matched from KV events) on r0; approximate")
        and "r2 (not_subscribed" in note
        for note in diagnosis.notes
    )
    [finding] = [f for f in diagnosis.findings if f.cause == "kv_events_fallback"]
    assert finding.data["replicas"] == {"r1": "stale"}  # auto: a replica without events is no fault
    assert "--kv-events-config" in finding.fix.summary


def test_the_doctor_says_which_precise_replicas_are_keyed_finer_than_their_engine() -> None:
    stats = _stats()
    stats["kv_events"]["replicas"]["r0"].update(block_size=128, keyed_at=16)
    stats["kv_events"]["replicas"]["r3"] = {"mode": "precise", "reason": None, "block_size": 16, "keyed_at": 16}
    notes = diagnose(Corpus(source="gateway", stats=stats)).notes
    assert any("precise (matched from KV events) on r0 (keyed at 16 of its 128), r3;" in note for note in notes), notes


def test_with_events_required_a_replica_without_them_is_a_finding_too() -> None:
    diagnosis = diagnose(Corpus(source="gateway", stats=_stats(enabled=True)))
    [finding] = [f for f in diagnosis.findings if f.cause == "kv_events_fallback"]
    assert finding.data["replicas"] == {"r1": "stale", "r2": "not_subscribed"}
    assert any("HTTP 404" in line for line in finding.evidence)
