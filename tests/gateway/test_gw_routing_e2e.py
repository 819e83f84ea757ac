"""Every policy spreads or pins through the gateway; replicas marked down get no traffic and come back."""

from __future__ import annotations

import collections

import httpx
import openai
import pytest
from gw_helpers import MODEL, chat, client, metric_sum, running_gateway, set_faults, wait_for

from gateway.http.server import RunningGateway


def replica_of(gw: RunningGateway, **headers: str) -> str:
    raw = client(gw).chat.completions.with_raw_response.create(
        model=MODEL, messages=chat("which replica"), max_tokens=1, extra_headers=headers or None
    )
    return raw.headers["x-prefix-gateway-replica"]


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
@pytest.mark.slow
def test_cache_blind_policies_spread_evenly(sim_urls: list[str], policy: str) -> None:
    with running_gateway(sim_urls, routes=[{"name": "main", "policy": policy}]) as gw:
        counts = collections.Counter(replica_of(gw) for _ in range(12))
    assert counts == {"r0": 3, "r1": 3, "r2": 3, "r3": 3}


@pytest.mark.slow
def test_random_uses_every_replica(sim_urls: list[str]) -> None:
    routes = [{"name": "main", "policy": "random", "policy_settings": {"seed": 3}}]
    with running_gateway(sim_urls, routes=routes) as gw:
        counts = collections.Counter(replica_of(gw) for _ in range(40))
    assert set(counts) == {"r0", "r1", "r2", "r3"}


@pytest.mark.slow
def test_session_policy_pins_each_session(sim_urls: list[str]) -> None:
    with running_gateway(sim_urls, routes=[{"name": "main", "policy": "session"}]) as gw:
        homes = {}
        for session in (f"user-{i}" for i in range(12)):
            seen = {replica_of(gw, **{"x-session-id": session}) for _ in range(3)}
            assert len(seen) == 1, f"session {session} moved: {seen}"
            homes[session] = seen.pop()
    assert len(set(homes.values())) > 1  # different sessions spread


@pytest.mark.slow
def test_routes_match_by_header_and_bind_pools(sim_urls: list[str]) -> None:
    routes = [
        {"name": "tenant-a", "match": {"models": [MODEL], "header": {"name": "x-tenant", "values": ["a"]}},
         "replicas": ["r3"]},
        {"name": "rest", "match": {"models": [MODEL]}, "replicas": ["r0", "r1"], "policy": "round_robin"},
    ]  # fmt: skip
    with running_gateway(sim_urls, routes=routes) as gw:
        assert {replica_of(gw, **{"x-tenant": "a"}) for _ in range(4)} == {"r3"}
        assert {replica_of(gw) for _ in range(4)} == {"r0", "r1"}


@pytest.mark.slow
def test_replica_marked_down_gets_no_traffic_and_returns_when_healthy(sims: list[str]) -> None:
    with running_gateway(sims, routes=[{"name": "main", "policy": "round_robin"}]) as gw:
        replica = gw.gateway.replicas["r1"]
        # the replica "restarts": /health and inference answer 503 until it is done (a minute,
        # far more than any busy machine needs for the checks below; ended early just after)
        httpx.post(f"{sims[1]}/sim/restart", json={"downtime_ms": 60_000}).raise_for_status()
        wait_for(lambda: not replica.healthy, what="r1 to be marked down by the active check")
        assert httpx.get(f"{gw.url}/metrics").text.count('prefix_gateway_replica_healthy{replica="r1"} 0.0') == 1
        during = collections.Counter(replica_of(gw) for _ in range(9))
        assert "r1" not in during and set(during) == {"r0", "r2", "r3"}
        set_faults(sims[1], reset=True)  # the restart is over (instead of waiting out its downtime)
        wait_for(lambda: replica.healthy, timeout=15, what="r1 to come back")
        after = collections.Counter(replica_of(gw) for _ in range(8))
        assert after["r1"] == 2


@pytest.mark.slow
def test_passive_health_takes_failing_replica_out(sims: list[str]) -> None:
    """/health is fine but completions fail with 500: real traffic takes the replica out."""
    health = {"passive_5xx_threshold": 2, "eject_s": 30}
    with running_gateway(sims[:2], health=health, routes=[{"name": "main", "policy": "round_robin"}]) as gw:
        httpx.post(f"{sims[0]}/sim/faults", json={"error_rate": 1.0, "error_status": 500}).raise_for_status()
        statuses = []
        for _ in range(8):
            try:
                replica_of(gw)
                statuses.append(200)
            except openai.InternalServerError as exc:
                statuses.append(exc.status_code)
        assert statuses.count(500) == 2  # two failures, then r0 is out
        assert not gw.gateway.replicas["r0"].healthy
        assert statuses[-4:] == [200] * 4


@pytest.mark.slow
def test_connection_refused_retries_on_another_replica(sims: list[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    # long health interval: the dead replica is still believed healthy when traffic arrives;
    # one refused connection is one failure, a run of passive_5xx_threshold (2 here) ejects
    urls = [dead, sims[0]]
    health = {"interval_s": 60, "passive_5xx_threshold": 2}
    with running_gateway(urls, health=health, routes=[{"name": "main", "policy": "round_robin"}]) as gw:
        r0 = gw.gateway.replicas["r0"]
        r0.healthy = True  # pretend the startup check has not noticed yet
        replies = [replica_of(gw) for _ in range(6)]
        assert replies == ["r1"] * 6  # every request answered, none by the dead replica
        text = httpx.get(f"{gw.url}/metrics").text
        assert metric_sum(text, "prefix_gateway_retries_total", route="main") == 2
        assert not r0.healthy and r0.ejections_total == 1


@pytest.mark.slow
def test_503_before_first_byte_is_retried_elsewhere_with_a_bound(sims: list[str]) -> None:
    routes = [{"name": "main", "policy": "round_robin"}]
    health = {"passive_5xx_threshold": 100}
    for url in sims[:2]:
        httpx.post(f"{url}/sim/faults", json={"error_rate": 1.0, "error_status": 503}).raise_for_status()
    # two failing replicas and one good one: two retries always reach the good one
    with running_gateway(sims[:3], upstream={"max_retries": 2}, health=health, routes=routes) as gw:
        assert [replica_of(gw) for _ in range(6)] == ["r2"] * 6
        retries = metric_sum(httpx.get(f"{gw.url}/metrics").text, "prefix_gateway_retries_total")
        assert 0 < retries <= 6 * 2
    # only failing replicas and one retry allowed: exactly one retry per request, then the 503 itself
    with running_gateway(sims[:2], upstream={"max_retries": 1}, health=health, routes=routes) as gw:
        for _ in range(4):
            with pytest.raises(openai.InternalServerError) as info:
                replica_of(gw)
            assert info.value.status_code == 503
            assert "simulated failure" in info.value.body["message"]
        assert metric_sum(httpx.get(f"{gw.url}/metrics").text, "prefix_gateway_retries_total") == 4
