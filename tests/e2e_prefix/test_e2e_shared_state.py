"""Two gateway processes sharing affinity through Redis (``state.backend: redis``).

Behind a Kubernetes Service, a conversation's turns reach different gateway pods.  Turn 1
goes through gateway A; gateway B, which never saw it, must then know where its history is
cached: its dry run says ``affinity`` with the blocks matched (a gateway with per-process
state would fall back to the ring), and the real turn 2 through B lands there with cache hits.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from e2e_helpers import ADMIN_KEY, MODEL, admin, ask, client, gateway, metric_sum, wait_for

from gateway.sim.launcher import ReplicaGroup

SYSTEM = {"role": "system", "content": "You are the support desk for a railway company. " * 40}


def shared(channel: str, redis_url: str) -> dict[str, Any]:
    return {"backend": "redis", "redis_url": redis_url, "channel": channel, "batch_interval_ms": 1}


def explain(gw: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
    with admin(gw) as http:
        response = http.post("/admin/explain", json={"model": MODEL, "messages": messages, "max_tokens": 8})
    response.raise_for_status()
    return response.json()["decision"]


def test_a_conversation_keeps_its_replica_across_gateways(
    fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    channel = f"test-e2e-affinity-{uuid.uuid4().hex}"
    with (
        gateway(fleet.urls, state=shared(channel, redis_url)) as gw_a,
        gateway(fleet.urls, state=shared(channel, redis_url)) as gw_b,
    ):
        for gw in (gw_a, gw_b):
            wait_for(lambda gw=gw: gw.gateway.state_sync.stats.connected, what="subscribed to Redis")
        messages = [SYSTEM, {"role": "user", "content": "My train was late, can I get a refund?"}]
        first = ask(client(gw_a), messages)
        messages += [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": "And for the return trip?"},
        ]
        # B learns where turn 1 went without having served it
        wait_for(lambda: gw_b.gateway.state_sync.stats.applied >= 1, what="B applied A's record")
        plan = explain(gw_b, messages)
        assert plan["replica"] == first.replica and plan["reason"] == "affinity"
        assert plan["matched_blocks"] > 0
        second = ask(client(gw_b), messages)
        assert second.replica == first.replica
        assert second.cached_tokens and second.cached_tokens >= first.prompt_tokens // 16 * 16 - 16
        with admin(gw_b) as http:
            text = http.get("/metrics").text
            state = http.get("/admin/stats").json()["state"]
        assert metric_sum(text, "prefix_gateway_state_sync_connected") == 1
        assert metric_sum(text, "prefix_gateway_state_sync_records_total", outcome="applied") >= 1
        assert state["backend"] == "redis" and state["channel"] == channel and state["applied"] >= 1


@pytest.mark.slow
def test_a_gateway_that_joins_is_ready_only_once_it_routes_like_its_peer(
    fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """Scale-up: B starts after A served a conversation; once B's /ready answers 200 it already
    knows where that conversation's history is (A's catch-up snapshot), before any traffic."""
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    channel = f"test-e2e-join-{uuid.uuid4().hex}"
    with gateway(fleet.urls, state=shared(channel, redis_url)) as gw_a:
        with httpx.Client(base_url=gw_a.url, timeout=5) as http:  # alone: ready without waiting long
            wait_for(lambda: http.get("/ready").status_code == 200, what="A ready")
            assert http.get("/ready").json()["catch_up"] == "no peers"
        messages = [SYSTEM, {"role": "user", "content": "Can I bring my bicycle on the train?"}]
        first = ask(client(gw_a), messages)
        messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "A folding one?"}]
        with gateway(fleet.urls, state=shared(channel, redis_url)) as gw_b, httpx.Client(base_url=gw_b.url) as http:
            wait_for(lambda: http.get("/ready").status_code == 200, what="B ready")
            assert http.get("/ready").json()["catch_up"] == "snapshot received"
            plan = explain(gw_b, messages)
            assert plan["replica"] == first.replica and plan["reason"] == "affinity"
            with admin(gw_b) as admin_http:
                state = admin_http.get("/admin/stats").json()["state"]
            assert state["snapshots_heard"] >= 1 and state["applied"] >= 1


def test_without_shared_state_the_other_gateway_does_not_know(
    fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: per-process state (the default) — B's plan has no affinity for turn 2."""
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    with gateway(fleet.urls) as gw_a, gateway(fleet.urls) as gw_b:
        messages = [SYSTEM, {"role": "user", "content": "Where is my luggage?"}]
        first = ask(client(gw_a), messages)
        messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "Thanks."}]
        assert explain(gw_a, messages)["reason"] == "affinity"
        assert explain(gw_b, messages)["reason"] != "affinity"
        with admin(gw_b) as http:
            assert http.get("/admin/stats").json()["state"] == {"backend": "memory"}


@pytest.mark.slow
def test_a_peers_requests_count_in_this_gateways_load(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """B routes around the replica A is keeping busy, although B itself sent nothing there."""
    import threading

    from gateway.sim.launcher import run_replicas

    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    channel = f"test-e2e-load-{uuid.uuid4().hex}"
    slow = {"time_scale": 1.0, "prefill_tokens_per_s": 2000.0, "decode_ms_per_token": 100.0}
    with (
        run_replicas(2, log_dir=tmp_path / "sims", disable_uvicorn_access_log=True, **slow) as urls,
        gateway(urls, state=shared(channel, redis_url)) as gw_a,
        gateway(urls, state=shared(channel, redis_url)) as gw_b,
    ):
        for gw in (gw_a, gw_b):
            wait_for(lambda gw=gw: gw.gateway.state_sync.stats.connected, what="subscribed to Redis")

        def prompt(i: int) -> list[dict[str, Any]]:
            return [{"role": "user", "content": f"Topic {i}: " + "tell me about it. " * 80}]

        # a request that B, on an idle fleet, would send to r0 (its ring home)
        probe = next(prompt(i) for i in range(50) if explain(gw_b, prompt(i))["replica"] == "r0")
        # A keeps r0 busy with a request of its own (2 s of decoding)
        busy = next(prompt(100 + i) for i in range(50) if explain(gw_a, prompt(100 + i))["replica"] == "r0")
        options = {"max_tokens": 20, "extra_body": {"ignore_eos": True}}
        thread = threading.Thread(target=ask, args=(client(gw_a), busy), kwargs=options, daemon=True)
        thread.start()
        wait_for(lambda: gw_b.gateway.replicas["r0"].peer_in_flight == 1, what="A's load reported to B")
        assert gw_b.gateway.replicas["r0"].in_flight == 0  # B itself sent nothing there
        assert explain(gw_b, probe)["replica"] == "r1"  # the ring home is busy with A's request
        thread.join(timeout=30)
        wait_for(lambda: gw_b.gateway.replicas["r0"].peer_in_flight == 0, what="A's request done, as B sees it")
