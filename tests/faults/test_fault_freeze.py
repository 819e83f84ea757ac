"""Frozen replicas (SIGSTOP): nothing hangs, nothing fails, serving resumes when they return."""

from __future__ import annotations

import signal
import threading
import time

import openai
import pytest
from fault_helpers import MODEL, Load, gateway, sdk, wait_for

from gateway.sim.launcher import ReplicaGroup

FREEZE_S = 2.5  # the scenario's length (not a wait for readiness): 12 health intervals of 0.2 s


@pytest.mark.slow
def test_all_replicas_frozen_then_back(fleet: ReplicaGroup) -> None:
    """Below the panic threshold the route keeps routing over all replicas: requests wait for
    the frozen fleet instead of failing with 503, and the first request after the thaw is served."""
    health = {"interval_s": 0.2, "timeout_s": 0.5}
    with gateway(fleet.urls, health=health) as gw:
        runner = gw.gateway.routes.routes[0].runner
        load = Load(gw.openai_base_url, concurrency=6, stream_share=0.5, max_tokens=10).start()
        extra: list[object] = []
        try:
            load.wait_done(12)
            frozen_at = time.monotonic()
            for replica in fleet.replicas:
                replica.signal(signal.SIGSTOP)
            wait_for(runner.in_panic, timeout=15, what="the route to enter panic mode")

            def one() -> None:
                try:
                    extra.append(
                        sdk(gw).chat.completions.create(
                            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
                        )
                    )
                except openai.APIError as exc:
                    extra.append(exc)

            senders = [threading.Thread(target=one) for _ in range(4)]
            for thread in senders:
                thread.start()
            wait_for(lambda: runner.panic_decisions >= 4, timeout=15, what="requests routed in panic mode")
            time.sleep(max(0.0, FREEZE_S - (time.monotonic() - frozen_at)))  # the freeze lasts FREEZE_S
            assert not any(r.healthy for r in gw.gateway.replicas.values())
            for replica in fleet.replicas:
                replica.signal(signal.SIGCONT)
            # the very next request is served, though no active check has seen the fleet back yet
            first = sdk(gw).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
            )
            assert first.choices
            for thread in senders:
                thread.join(30)
            load.wait_done(12)
        finally:
            for replica in fleet.replicas:
                replica.signal(signal.SIGCONT)
            assert load.stop(), "a request outlived its client timeout"
        assert load.tally.client_failures == 0 and load.tally.hung == 0, load.tally.as_dict()
        assert len(extra) == 4 and all(not isinstance(e, Exception) for e in extra), extra
        wait_for(lambda: all(r.healthy for r in gw.gateway.replicas.values()), timeout=10, what="all healthy")


@pytest.mark.slow
def test_requests_stuck_on_a_frozen_replica_move_elsewhere(fleet: ReplicaGroup) -> None:
    """One replica freezes with requests waiting on it: once it is marked down they are
    retried on a healthy replica, long before it comes back."""
    health = {"interval_s": 0.2, "timeout_s": 0.5}
    with gateway(fleet.urls, health=health) as gw:
        r1 = gw.gateway.replicas["r1"]
        load = Load(gw.openai_base_url, concurrency=6, stream_share=0, max_tokens=30).start()
        try:
            load.wait_done(6)
            wait_for(lambda: r1.in_flight >= 1, timeout=20, what="a request in flight on r1")
            fleet.replicas[1].signal(signal.SIGSTOP)
            wait_for(lambda: not r1.healthy, timeout=10, what="r1 marked down")
            # still frozen: nothing is left waiting on it, and traffic flows
            wait_for(lambda: r1.in_flight == 0, timeout=10, what="r1's waiting requests to move")
            load.wait_done(12)
            assert r1.cancelled_on_down >= 1
        finally:
            fleet.replicas[1].signal(signal.SIGCONT)
            assert load.stop()
        assert load.tally.client_failures == 0 and load.tally.hung == 0, load.tally.as_dict()
