"""Only a replica that really served a request (a 2xx answer) is believed to hold its prompt.

The affinity index records a placement when it is decided, so the next request of a burst
follows at once.  When the replica then refuses the prompt (a 400: too long, a bad
parameter), or the client leaves before its first byte (499), the replica computed nothing:
the keys that decision added are withdrawn — here and, through Redis, on every peer — while
what the replica held before (the shared head of earlier served requests) stays.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest
from e2e_helpers import ADMIN_KEY, MODEL, admin, ask, client, gateway, metric_sum, wait_for

from gateway.sim.launcher import ReplicaGroup
from tests.sdk import openai_client

SYSTEM = {"role": "system", "content": "You are the help desk of a city library. " * 40}


def question(text: str) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": text + " " + "Please explain in detail. " * 12}]


def explain(gw: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The dry-run decision's detail (matched blocks) with its replica and reason."""
    with admin(gw) as http:
        response = http.post("/admin/explain", json={"model": MODEL, "messages": messages, "max_tokens": 8})
    response.raise_for_status()
    report = response.json()
    return {**report["detail"], "replica": report["decision"]["replica"], "reason": report["decision"]["reason"]}


def set_faults(fleet: ReplicaGroup, **faults: Any) -> None:
    with httpx.Client(timeout=10) as http:
        for url in fleet.urls:
            http.post(f"{url}/sim/faults", json=faults).raise_for_status()


def settled(*gateways: Any) -> None:
    """Wait until no request is in flight anywhere, as each gateway sees it (its own and its
    peers' reports): the last request was released (what it learned kept or taken back), and
    the load bound does not steer the dry runs that follow."""
    for gw in gateways:
        replicas = gw.gateway.replicas.values()
        wait_for(lambda r=replicas: all(x.in_flight == 0 and x.peer_in_flight == 0 for x in r), what="idle")


def shared(channel: str, redis_url: str) -> dict[str, Any]:
    return {"backend": "redis", "redis_url": redis_url, "channel": channel, "batch_interval_ms": 1}


def test_a_replica_answering_400_is_not_believed_to_hold_the_prompt(
    fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    with gateway(fleet.urls) as gw:
        refused = question("How do I renew a book online?")
        set_faults(fleet, error_rate=1.0, error_status=400)
        with pytest.raises(openai.BadRequestError):
            ask(client(gw), refused)
        settled(gw)
        plan = explain(gw, refused)
        assert plan["best_matched_blocks"] == 0 and plan["reason"] == "ring"  # no belief it holds the prompt
        with admin(gw) as http:
            affinity = http.get("/admin/stats").json()["routes"]["main"]["policy_state"]["affinity"]
        assert affinity["keys"] == 0 and affinity["entries"] == 0


def test_a_refused_request_keeps_the_head_the_replica_already_held(
    fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The withdrawal takes back only what the refused request added: the shared head the
    replica computed for an earlier, served request still routes there."""
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    with gateway(fleet.urls) as gw:
        served = ask(client(gw), question("When does the library open?"))
        settled(gw)
        refused, unseen = question("Can I bring my dog inside?"), question("Is there parking nearby?")
        head_only = explain(gw, unseen)  # what the replica holds of a new question: the system prompt
        assert head_only["replica"] == served.replica and head_only["best_matched_blocks"] > 0
        set_faults(fleet, error_rate=1.0, error_status=400)
        with pytest.raises(openai.BadRequestError):
            ask(client(gw), refused)
        settled(gw)
        plan = explain(gw, refused)
        assert plan["replica"] == served.replica and plan["reason"] == "affinity"  # the head stayed
        assert plan["best_matched_blocks"] == head_only["best_matched_blocks"] < plan["blocks"]
        assert explain(gw, question("When does the library open?"))["best_matched_blocks"] > plan["best_matched_blocks"]


def test_a_client_gone_before_the_first_byte_teaches_nothing(
    fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    with gateway(fleet.urls) as gw:
        abandoned = question("What is the fine for a late return?")
        set_faults(fleet, extra_latency_ms=5000)  # the replica is still queueing when the client leaves
        impatient = openai_client(gw.openai_base_url, api_key="unused", timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model=MODEL, messages=abandoned, max_tokens=8, stream=True)

        def disconnects() -> float:
            text = httpx.get(f"{gw.url}/metrics").text
            return metric_sum(text, "prefix_gateway_errors_total", kind="client_disconnect")

        wait_for(disconnects, what="the gateway saw the client leave (499)")
        settled(gw)
        plan = explain(gw, abandoned)
        assert plan["best_matched_blocks"] == 0 and plan["reason"] == "ring"


def test_a_peer_gateway_sees_the_withdrawal_and_keeps_the_head(
    fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """Gateway B heard A's record at decision time; A's withdrawal (the replica answered 400)
    reaches B over a real Redis, and B, like A, keeps the head of an earlier served request."""
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    channel = f"test-e2e-withdraw-{uuid.uuid4().hex}"
    with (
        gateway(fleet.urls, state=shared(channel, redis_url)) as gw_a,
        gateway(fleet.urls, state=shared(channel, redis_url)) as gw_b,
    ):
        for gw in (gw_a, gw_b):
            wait_for(lambda gw=gw: gw.gateway.state_sync.stats.connected, what="subscribed to Redis")
            # each has sent the other its (empty) catch-up snapshot: no snapshot crosses what follows
            wait_for(lambda gw=gw: httpx.get(f"{gw.url}/ready").status_code == 200, what="caught up")
        served = ask(client(gw_a), question("How many books can I borrow?"))
        wait_for(lambda: gw_b.gateway.state_sync.stats.applied >= 1, what="B applied A's served record")
        refused, unseen = question("Do you lend laptops?"), question("Are there study rooms?")
        set_faults(fleet, error_rate=1.0, error_status=400)
        with pytest.raises(openai.BadRequestError):
            ask(client(gw_a), refused)
        wait_for(lambda: gw_b.gateway.state_sync.stats.withdrawals_applied >= 1, what="B applied A's withdrawal")
        assert gw_b.gateway.state_sync.stats.applied >= 2  # it had heard the refused request's record first
        wait_for(lambda: gw_a.gateway.state_sync.stats.withdrawn == 1, what="A counted its one withdrawal")
        settled(gw_a, gw_b)
        for gw in (gw_a, gw_b):
            plan, head_only = explain(gw, refused), explain(gw, unseen)
            assert plan["replica"] == served.replica and head_only["replica"] == served.replica
            assert plan["best_matched_blocks"] == head_only["best_matched_blocks"] > 0
        with admin(gw_b) as http:
            text = http.get("/metrics").text
        assert metric_sum(text, "prefix_gateway_state_sync_records_total", outcome="withdrawals_applied") >= 1
