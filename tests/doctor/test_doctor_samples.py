"""/admin/samples: off by default, admin key required, bounded by count and bytes, no prompt text
unless the debug setting says so."""

from __future__ import annotations

import json

import pytest
from doctor_helpers import ADMIN_KEY, INSTRUCTIONS, admin, gateway, planted_traffic, route, send

from gateway.config import SampleSettings
from gateway.observe.samples import SampleBuffer
from gateway.sim.launcher import ReplicaGroup


def test_off_by_default_and_behind_the_admin_key(shared_fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    assert SampleSettings().enabled is False and SampleSettings().include_text is False
    with gateway(shared_fleet.urls, [route()]) as gw:
        with admin(gw) as api:
            off = api.get("/admin/samples")
        assert off.status_code == 404
        assert off.json()["error"]["code"] == "samples_disabled"
        assert "samples.enabled" in off.json()["error"]["message"]
        assert gw.gateway.samples is None  # nothing is recorded either
    with gateway(shared_fleet.urls, [route()], samples={"enabled": True}) as gw:
        with admin(gw, key=None) as anonymous, admin(gw, key="wrong") as wrong:
            assert anonymous.get("/admin/samples").status_code == 401
            assert wrong.get("/admin/samples").status_code == 401
        with admin(gw) as api:
            assert api.get("/admin/samples").status_code == 200


def test_samples_keep_shapes_not_text(shared_fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    bodies = planted_traffic(6)
    with gateway(shared_fleet.urls, [route()], samples={"enabled": True}) as gw, admin(gw) as api:
        send(gw, bodies)
        response = api.get("/admin/samples")
    assert response.status_code == 200
    data = response.json()
    raw = response.text
    assert data["enabled"] is True and data["include_text"] is False and data["count"] == 6
    # no prompt text, no volatile values, no salt: only shapes, lengths and keyed fingerprints
    for secret in ("ACME", "Policy 3", "lookup_order", "2025-03-04", "tenant-a", "Say hi", "Where is"):
        assert secret not in raw
    assert bodies[0]["tools"][0]["function"]["description"][20:40] not in raw
    chat = data["samples"][0]
    assert [p["role"] for p in chat["parts"]] == ["tool_definition", "system", "user"]
    assert chat["parts"][1]["chars"] == len(bodies[0]["messages"][0]["content"])
    assert all(len(p["fp"]) == 8 for p in chat["parts"])
    assert chat["salt"] is not None and len(chat["salt"]) == 8
    assert chat["prompt_tokens"] > 500 and chat["keys"] and chat["keys_relocated"]
    # where relocation moves a value (from the first request whose value was seen to change)
    last_chat = [sample for sample in data["samples"] if sample["endpoint"] == "chat"][-1]
    assert sorted(map(tuple, last_chat["spans"])) == [
        ("messages[0].content", "iso_datetime"),
        ("tools[0].function.description", "uuid"),
    ]
    assert "body" not in chat
    assert data["routes"]["main"]["block_size"] == 16 and data["routes"]["main"]["normalize"] == "report"


def test_debug_setting_keeps_the_body(shared_fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    with gateway(shared_fleet.urls, [route()], samples={"enabled": True, "include_text": True}) as gw, admin(gw) as api:
        send(gw, planted_traffic(2))
        data = api.get("/admin/samples").json()
    assert data["include_text"] is True
    assert INSTRUCTIONS in data["samples"][0]["body"]["messages"][0]["content"]


def _sample(i: int, size: int) -> dict[str, object]:
    return {"i": i, "pad": "x" * size}


def test_buffer_is_bounded_by_count_and_bytes() -> None:
    by_count = SampleBuffer(SampleSettings(enabled=True, max_count=5), list)
    for i in range(12):
        by_count.add(_sample(i, 10))
    snap = by_count.snapshot()
    assert [s["i"] for s in snap["samples"]] == [7, 8, 9, 10, 11]  # the newest five, oldest first
    assert snap["recorded"] == 12 and snap["dropped"] == 7

    by_bytes = SampleBuffer(SampleSettings(enabled=True, max_count=1000, max_bytes=4096), list)
    for i in range(40):
        by_bytes.add(_sample(i, 1000))
    snap = by_bytes.snapshot()
    size = sum(len(json.dumps(s, separators=(",", ":")).encode()) for s in snap["samples"])
    assert size == snap["bytes"] <= 4096
    assert snap["count"] == 4 and snap["samples"][-1]["i"] == 39


async def test_the_buffer_follows_a_config_reload() -> None:
    """A reload swaps routes: the snapshot and the shadow pipeline follow the new settings."""
    from gateway.observe.outcome import Outcome
    from gateway.service import Gateway
    from tests.configs import gateway_config

    urls = ["http://127.0.0.1:9"]
    gw = Gateway(gateway_config(urls, routes=[route("report")], samples={"enabled": True}))
    body = planted_traffic(1)[0]
    outcome = Outcome(route="main", endpoint="chat", status=200, prompt_tokens=900)
    assert gw.samples is not None
    gw.samples.record(gw.plan("chat", body, {}), body, outcome)
    await gw.apply(gateway_config(urls, routes=[route("relocate")], samples={"enabled": True}))
    gw.samples.record(gw.plan("chat", body, {}), body, outcome)
    snap = gw.samples.snapshot()
    assert snap["routes"]["main"]["normalize"] == "relocate"
    before, after = snap["samples"]
    assert before["keys_relocated"] and after["keys_relocated"] is None  # the route relocates itself now
