"""A replica that answers 30 % of its requests with 503: clients never notice."""

from __future__ import annotations

from fault_helpers import Load, gateway, set_faults

from gateway.sim.launcher import ReplicaGroup


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
