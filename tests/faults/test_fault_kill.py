"""A replica killed (SIGKILL) under mixed streaming and non-streaming load, then restarted."""

from __future__ import annotations

import pytest
from fault_helpers import Load, gateway, replica_of, wait_for

from gateway.sim.launcher import ReplicaGroup

SESSIONS = [f"session-{i}" for i in range(16)]


@pytest.mark.slow
def test_kill_one_of_four_under_mixed_load(fleet: ReplicaGroup) -> None:
    """0 failed non-streaming requests (a reset before headers is retried), every stream in
    flight on the killed replica ends with an error event, keys move away and come back."""
    routes = [{"name": "main", "policy": "session"}]
    with gateway(fleet.urls, routes=routes) as gw:
        home = {s: replica_of(gw, s) for s in SESSIONS}
        victim = max(set(home.values()), key=list(home.values()).count)
        index = int(victim[1:])
        replica = gw.gateway.replicas[victim]
        load = Load(gw.openai_base_url, concurrency=6, stream_share=0.5, max_tokens=30).start()
        try:
            load.wait_done(12)
            wait_for(lambda: replica.in_flight >= 2, timeout=20, what=f"requests in flight on {victim}")
            fleet.kill(index)
            wait_for(lambda: not replica.healthy, timeout=10, what=f"{victim} marked down")
            load.wait_done(20)
            during = {s: replica_of(gw, s) for s in SESSIONS}
            fleet.restart(index)
            wait_for(lambda: replica.healthy, timeout=20, what=f"{victim} back")
            after = {s: replica_of(gw, s) for s in SESSIONS}
            load.wait_done(12)
        finally:
            assert load.stop(), "a request outlived its client timeout"
        tally = load.tally
        assert tally.failed == {} and tally.stream_failed == {}, tally.as_dict()  # 0 client-visible failures...
        assert tally.broken == 0 and tally.hung == 0, tally.as_dict()  # ...no cut stream, nothing hung
        assert set(tally.error_events) <= {"upstream_stream_failed"}, tally.as_dict()  # streams cut by the kill
        assert tally.ok > 0 and tally.stream_ok > 0
        moved = [s for s in SESSIONS if home[s] == victim]
        assert all(during[s] != victim for s in moved)  # its keys moved...
        assert all(during[s] == home[s] for s in SESSIONS if s not in moved)  # ...and only those
        assert after == home  # and they all came back
