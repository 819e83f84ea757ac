"""A replica that answers 30 % of its requests with 503: clients never notice."""

from __future__ import annotations

import pytest
from fault_helpers import MODEL, Load, gateway, sdk, set_faults, wait_for

from gateway.sim.launcher import ReplicaGroup


@pytest.mark.slow
def test_thirty_percent_503s_from_one_replica_are_invisible(fleet: ReplicaGroup) -> None:
    set_faults(fleet.urls[2], error_rate=0.3, error_status=503)
    with gateway(fleet.urls, routes=[{"name": "main", "policy": "round_robin"}]) as gw:
        load = Load(gw.openai_base_url, concurrency=6, stream_share=0.5, max_tokens=5).start()
        try:
            load.wait_done(160)
        finally:
            assert load.stop()
        r2 = gw.gateway.replicas["r2"]
        assert load.tally.client_failures == 0, load.tally.as_dict()
        assert r2.failures_total > 0  # the faults did happen (and were retried)


def test_failed_attempts_teach_the_affinity_index_nothing(fleet: ReplicaGroup) -> None:
    """Requests placed on a replica that answers 503 are retried elsewhere: the prefix index
    credits their prefixes to the replica that served them, never to the one that failed."""
    set_faults(fleet.urls[0], error_rate=1.0, error_status=503)
    routes = [{"name": "main", "policy": "prefix"}]
    with gateway(fleet.urls[:2], routes=routes, health={"passive_5xx_threshold": 100}) as gw:
        client = sdk(gw)
        for i in range(8):
            words = " ".join(f"w{i}x{j}" for j in range(120))  # distinct prompts, several blocks each
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words}], max_tokens=1)
        index = gw.gateway.routes.routes[0].runner.policy.index
        assert gw.gateway.replicas["r0"].failures_total > 0  # some were placed on r0 first
        assert index.entries("r0") == 0
        assert index.entries("r1") > 0


@pytest.mark.slow
def test_a_slow_replica_is_deprioritized_not_ejected(fleet: ReplicaGroup) -> None:
    """A replica whose streams start over a second late gets only every slow_probe_every-th
    request while it is slow (a latency probe); it is never ejected."""
    set_faults(fleet.urls[1], extra_latency_ms=1500)  # the others answer in tens of ms
    health = {"slow_ttft_factor": 3.0, "slow_min_extra_s": 0.75, "slow_probe_every": 20}
    routes = [{"name": "main", "policy": "round_robin"}]  # blind to load: only the slow rule moves traffic
    with gateway(fleet.urls, health=health, routes=routes) as gw:
        r1 = gw.gateway.replicas["r1"]

        def started() -> int:  # requests sent to r1 so far: finished + in flight
            tally = gw.gateway.stats.by_route_replica.get(("main", "r1"))
            return (tally.requests if tally else 0) + r1.in_flight

        load = Load(gw.openai_base_url, concurrency=6, stream_share=1.0, max_tokens=5).start()
        try:
            wait_for(lambda: r1.slow, timeout=60, what="r1 flagged slow")
            before = started()
            load.wait_done(60)
            served_while_slow = started() - before
        finally:
            assert load.stop()
        assert load.tally.client_failures == 0, load.tally.as_dict()
        assert r1.healthy and r1.ejections_total == 0
        # round robin would give it a quarter (15 of 60); slow, every 20th (3 of 60)
        assert served_while_slow <= 6, served_while_slow
