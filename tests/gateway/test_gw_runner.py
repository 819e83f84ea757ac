"""The runner enforces the shared rules: healthy-only, in-flight at decision time, observe, fallback."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import pytest

from gateway.config import HealthSettings, ReplicaConfig
from gateway.errors import NoHealthyReplica
from gateway.replicas.pool import Replica
from gateway.routing.base import Decision, ReplicaView, RequestView
from gateway.routing.runner import PolicyRunner


class NullClient:
    base_url = "http://unused"


def replicas(n: int, **health: Any) -> list[Replica]:
    settings = HealthSettings(**health)
    return [Replica(ReplicaConfig(name=f"r{i}", url=f"http://h:{i + 1}"), NullClient(), settings) for i in range(n)]


class Recording:
    """A policy that records what it saw and picks the last eligible replica."""

    name: ClassVar[str] = "recording"

    def __init__(self, pick: str | None = None) -> None:
        self.seen: list[list[ReplicaView]] = []
        self.observed: list[tuple[str, int | None]] = []
        self.pick = pick

    def choose(self, request: RequestView, views: Sequence[ReplicaView]) -> Decision:
        self.seen.append(list(views))
        return self.peek(request, views)

    def peek(self, request: RequestView, views: Sequence[ReplicaView]) -> Decision:
        return Decision(self.pick or views[-1].name, "test")

    def set_members(self, members: Sequence[ReplicaView]) -> None:
        return None

    def observe(self, request: RequestView, decision: Decision, cached_tokens: int | None) -> None:
        self.observed.append((decision.replica, cached_tokens))


REQ = RequestView("id", "route", "m", "chat")


def test_only_healthy_and_not_excluded_replicas_are_offered() -> None:
    pool = replicas(3)
    policy = Recording()
    runner = PolicyRunner("route", "recording", policy, pool)
    pool[1].healthy = False
    decision, replica = runner.decide(REQ, exclude=["r2"])
    assert [v.name for v in policy.seen[-1]] == ["r0"]
    assert replica is pool[0] and decision.reason == "test"


def test_in_flight_is_counted_at_decision_time_and_observe_gets_cached_tokens() -> None:
    pool = replicas(2)
    policy = Recording()
    runner = PolicyRunner("route", "recording", policy, pool)
    decision, replica = runner.decide(REQ)
    runner.acquire(replica, REQ, decision)
    runner.decide(REQ)
    assert {v.name: v.in_flight for v in policy.seen[-1]} == {"r0": 0, "r1": 1}
    runner.release(replica, REQ, decision, 48, completed=True)
    assert replica.in_flight == 0
    assert policy.observed == [("r1", 48)]
    runner.acquire(replica, REQ, decision)
    runner.release(replica, REQ, decision, None, completed=False)
    assert policy.observed == [("r1", 48)]  # failed requests teach nothing


def test_uncached_prompt_tokens_are_queued_prefill_until_handed_back() -> None:
    """acquire() charges prompt minus predicted-cached tokens; policies see it until prefill_done()."""
    pool = replicas(2)
    policy = Recording()
    runner = PolicyRunner("route", "recording", policy, pool)
    request = RequestView("id", "route", "m", "chat", prompt_tokens=4096, prompt_tokens_estimate=10_000)
    decision, replica = runner.decide(request)
    cached = Decision(decision.replica, decision.reason, {"predicted_cached_tokens": 6_000})
    first = runner.acquire(replica, request, cached)
    second = runner.acquire(replica, request, Decision(decision.replica, decision.reason))
    assert (first, second) == (4_000, 10_000)
    runner.decide(request)
    assert {v.name: v.pending_prefill_tokens for v in policy.seen[-1]} == {"r0": 0, "r1": 14_000}
    runner.prefill_done(replica, first)
    assert replica.pending_prefill_tokens == 10_000
    runner.prefill_done(replica, second)
    assert replica.pending_prefill_tokens == 0
    # a route without prompt estimates (a cache-blind policy) charges nothing
    assert runner.acquire(replica, REQ, decision) == 0 and replica.pending_prefill_tokens == 0


def test_no_healthy_replica_is_a_503_naming_the_route() -> None:
    pool = replicas(2, panic_threshold_percent=0)  # panic mode off: see test_gw_outlier for it on
    runner = PolicyRunner("chat", "recording", Recording(), pool)
    for r in pool:
        r.healthy = False
    with pytest.raises(NoHealthyReplica, match=r"no healthy replica for route 'chat' \(0 of 2 healthy\)") as info:
        runner.decide(REQ)
    assert info.value.status == 503


def test_a_policy_returning_an_ineligible_replica_falls_back() -> None:
    pool = replicas(2)
    pool[0].healthy = False
    runner = PolicyRunner("route", "recording", Recording(pick="r0"), pool)
    decision, replica = runner.decide(REQ)
    assert replica is pool[1] and decision.reason == "fallback"


def test_health_state_machine() -> None:
    (replica,) = replicas(1, unhealthy_threshold=2, healthy_threshold=2, passive_5xx_threshold=2, eject_s=10)
    replica.record_probe(False, "HTTP 503", now=1.0)
    assert replica.healthy  # one failure is below the threshold
    replica.record_probe(False, "HTTP 503", now=2.0)
    assert not replica.healthy
    replica.record_probe(True, now=3.0)
    assert not replica.healthy
    replica.record_probe(True, now=4.0)
    assert replica.healthy
    replica.report_5xx(500, now=5.0)
    replica.report_ok()
    replica.report_5xx(500, now=5.5)
    assert replica.healthy  # not consecutive
    replica.report_5xx(500, now=6.0)
    assert not replica.healthy
    replica.record_probe(True, now=7.0)
    replica.record_probe(True, now=8.0)
    assert not replica.healthy  # ejected until 16.0 even though /health is fine
    replica.record_probe(True, now=16.5)
    assert replica.healthy
    replica.report_transport_error("connection refused", now=20.0)
    assert not replica.healthy and "connection refused" in (replica.last_error or "")


def test_an_attempt_that_served_nothing_is_taken_back_from_the_policy() -> None:
    class Forgetting(Recording):
        def __init__(self) -> None:
            super().__init__()
            self.forgotten: list[str] = []

        def forget_attempt(self, request: RequestView, decision: Decision) -> None:
            self.forgotten.append(decision.replica)

    pool = replicas(2)
    policy = Forgetting()
    runner = PolicyRunner("route", "recording", policy, pool)
    decision, replica = runner.decide(REQ)
    runner.acquire(replica, REQ, decision)
    runner.release(replica, REQ, decision, None, completed=False, served=False)
    assert policy.forgotten == [replica.name] and policy.observed == []
    decision, replica = runner.decide(REQ)
    runner.acquire(replica, REQ, decision)
    runner.release(replica, REQ, decision, None, completed=False)  # aborted after it served: kept
    assert policy.forgotten == [replica.name]
