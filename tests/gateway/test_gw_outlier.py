"""Outlier detection: ejection rules, back-off, probation, the fleet cap, panic mode, slow replicas.

Unit tests on ``Replica``/``Fleet`` with explicit clocks; the end-to-end behaviour under real
faults is in tests/faults/.
"""

from __future__ import annotations

from typing import Any

from gateway.config import HealthSettings, ReplicaConfig
from gateway.replicas.outlier import Fleet, select_eligible
from gateway.replicas.pool import Replica
from gateway.routing.base import Decision, ReplicaView, RequestView
from gateway.routing.runner import PolicyRunner


class NullClient:
    base_url = "http://unused"


def fleet(n: int, pools: list[list[int]] | None = None, **health: Any) -> list[Replica]:
    settings = HealthSettings(**health)
    members: list[Replica] = []
    by_pool = None if pools is None else (lambda: [[members[i] for i in p] for p in pools])
    group = Fleet(lambda: members, settings, by_pool)
    members.extend(
        Replica(ReplicaConfig(name=f"r{i}", url=f"http://h:{i + 1}"), NullClient(), settings, fleet=group)  # type: ignore[arg-type]
        for i in range(n)
    )
    return members


def test_one_connect_failure_never_ejects_a_run_does() -> None:
    (r,) = fleet(1, passive_5xx_threshold=5)
    for i in range(4):
        r.report_transport_error("connect: connect timed out", now=1.0 + i)
        assert r.healthy
    r.report_ok(now=5.0)  # a success breaks the run
    for i in range(4):
        r.report_transport_error("connect: refused", now=6.0 + i)
    assert r.healthy
    r.report_5xx(502, now=10.0)  # 5xx and transport failures count together
    assert not r.healthy and r.ejections_total == 1


def test_failure_rate_over_a_window_ejects_without_a_consecutive_run() -> None:
    (r,) = fleet(1, passive_5xx_threshold=100, failure_rate_percent=30, failure_rate_min_requests=20)
    t = 0.0
    for i in range(40):  # every third request fails: never 2 in a row, 33 % overall
        t += 0.1
        if i % 3 == 2:
            r.report_5xx(503, now=t)
        else:
            r.report_ok(now=t)
        if not r.healthy:
            break
    assert not r.healthy and "requests failed in" in (r.last_error or "")


def test_failures_spread_beyond_the_window_do_not_add_up() -> None:
    (r,) = fleet(1, passive_5xx_threshold=100, failure_rate_percent=30, failure_rate_min_requests=5)
    for i in range(30):  # one failure every 20 s, 4 successes in between: window of 10 s
        t = i * 5.0
        (r.report_5xx(503, now=t) if i % 4 == 0 else r.report_ok(now=t))
    assert r.healthy


def test_ejection_time_doubles_per_repeat_up_to_the_cap_and_probation_re_ejects() -> None:
    (r,) = fleet(1, passive_5xx_threshold=3, eject_s=1.0, max_eject_s=3.0)
    now = 0.0
    lengths = []
    for _ in range(4):
        failures = 3 if not r.probation else 1  # back from an ejection, one failure is enough
        for _ in range(failures):
            r.report_5xx(500, now=now)
        assert not r.healthy
        lengths.append(round(r.ejected_until - now, 6))
        r.record_probe(True, now=r.ejected_until - 0.01)
        assert not r.healthy  # a good /health does not end an ejection early
        now = r.ejected_until
        r.record_probe(True, now=now)
        assert r.healthy and r.probation
    assert lengths == [1.0, 2.0, 3.0, 3.0]
    for _ in range(3):  # threshold successes in a row end the probation
        r.report_ok(now=now)
    assert not r.probation
    r.report_5xx(500, now=now)
    assert r.healthy


def test_back_off_starts_over_after_a_long_good_spell() -> None:
    (r,) = fleet(1, passive_5xx_threshold=1, eject_s=1.0, max_eject_s=10.0)
    r.report_5xx(500, now=0.0)
    r.record_probe(True, now=1.0)
    r.report_5xx(500, now=2.0)
    assert r.ejected_until == 4.0  # second in a row: 2 s
    r.record_probe(True, now=4.0)
    r.report_5xx(500, now=100.0)  # 96 s later: a first ejection again
    assert r.ejected_until == 101.0


def test_at_most_the_configured_share_of_the_fleet_is_ejected() -> None:
    pool = fleet(4, passive_5xx_threshold=1, max_ejected_percent=50)
    for r in pool:
        r.report_5xx(500, now=1.0)
    assert [r.healthy for r in pool] == [False, False, True, True]
    assert pool[2].eject_denied == 1 and pool[3].eject_denied == 1
    # an active check is never capped: a dead replica is down whatever the others do
    pool[3].record_probe(False, "refused", now=1.0)
    pool[3].record_probe(False, "refused", now=1.1)
    assert not pool[3].healthy


def test_a_single_replica_may_be_ejected() -> None:
    (r,) = fleet(1, passive_5xx_threshold=1, max_ejected_percent=10)
    r.report_5xx(500, now=1.0)
    assert not r.healthy


class Last:
    name = "last"

    def choose(self, request: RequestView, views: list[ReplicaView]) -> Decision:
        return Decision(views[-1].name, "last")

    peek = choose

    def set_members(self, members: list[ReplicaView]) -> None:
        pass

    def observe(self, *args: object) -> None:
        pass


REQ = RequestView(request_id="x", route="main", model="m", endpoint="chat", stream=False)


def test_panic_mode_routes_over_all_replicas_and_passive_success_recovers() -> None:
    pool = fleet(4, panic_threshold_percent=50)
    runner = PolicyRunner("main", "last", Last(), pool)  # type: ignore[arg-type]
    for r in pool[:3]:
        r.record_probe(False, "timeout", now=1.0)
        r.record_probe(False, "timeout", now=1.1)
    # 1 of 4 healthy (25 % < 50 %): panic, every replica may be chosen
    eligible, panic = select_eligible(pool)
    assert panic and eligible == pool
    assert runner.in_panic()
    # a retry in panic mode prefers a healthy replica it has not tried
    assert select_eligible(pool, exclude=["r0"])[0] == [pool[3]]
    _, replica = runner.decide(REQ)
    assert replica is pool[3] and runner.panic_decisions == 1
    pool[3].record_probe(False, "timeout", now=1.0)
    pool[3].record_probe(False, "timeout", now=1.1)
    assert select_eligible(pool)[0] == pool  # all down: still all
    pool[0].report_ok(now=2.0)  # panic traffic got an answer: it is back at once
    assert pool[0].healthy and pool[0].passive_recoveries == 1


def test_without_panic_mode_an_all_down_route_has_no_choice() -> None:
    pool = fleet(2, panic_threshold_percent=0)
    for r in pool:
        r.record_probe(False, "x", now=1.0)
        r.record_probe(False, "x", now=1.1)
    assert select_eligible(pool) == ([], False)


def test_a_slow_replica_is_deprioritized_not_ejected_and_still_probed() -> None:
    pool = fleet(4, slow_ttft_factor=3.0, slow_min_extra_s=0.5, slow_probe_every=5)
    for i in range(10):
        for r in pool[:3]:
            r.record_ttfb(0.1, now=10.0 + i)
        pool[3].record_ttfb(2.1, now=10.0 + i)
    assert [r.slow for r in pool] == [False, False, False, True]
    assert pool[3].healthy
    offers = [select_eligible(pool)[0] for _ in range(10)]
    assert offers.count([pool[3]]) == 2  # every 5th request goes to it alone (a latency probe)
    assert offers.count(pool[:3]) == 8  # the others never see it
    assert select_eligible(pool[3:])[0] == [pool[3]]  # alone, a slow replica still serves
    for i in range(20):  # it recovers: its probes bring the average down
        pool[3].record_ttfb(0.1, now=30.0 + i)
    assert not pool[3].slow


def test_a_replica_late_because_more_work_was_queued_on_it_is_not_slow() -> None:
    """Under load the holder of a hot prefix (a conversation's home) answers seconds later than
    the others because the gateway queued more prefill there, at the same speed per token:
    not slow, and its cache stays in use.  The same lateness with the same work is slow."""
    pool = fleet(4, slow_ttft_factor=3.0, slow_min_extra_s=0.5)
    for i in range(10):
        for r in pool[:3]:
            r.record_ttfb(0.1, 2_000, now=10.0 + i)  # ~3k tokens of work (with the floor) in 0.1 s
        pool[3].record_ttfb(2.1, 62_000, now=10.0 + i)  # 20x the work ahead, 21x the time
    assert [r.slow for r in pool] == [False, False, False, False]
    assert pool[3].ttfb_ewma is not None and pool[3].ttfb_ewma > 2.0  # late, by raw time
    for i in range(20):  # now as late with no more work than the others: a third of their speed
        pool[3].record_ttfb(2.1, 2_000, now=30.0 + i)
    assert [r.slow for r in pool] == [False, False, False, True]
    assert pool[3].outlier_snapshot()["ttfb_per_1k_work_tokens_s"] > 0.5  # type: ignore[operator]


def test_without_work_figures_slow_is_judged_on_raw_time() -> None:
    """A route without prompt estimates gives samples without work: raw times decide (as
    before), also when only some replicas have work figures."""
    pool = fleet(3, slow_ttft_factor=3.0, slow_min_extra_s=0.5)
    for i in range(10):
        pool[0].record_ttfb(0.1, 2_000, now=i)
        pool[1].record_ttfb(0.1, now=i)
        pool[2].record_ttfb(2.1, 60_000, now=i)
    assert [r.slow for r in pool] == [False, False, True]


def test_small_absolute_differences_are_not_slow() -> None:
    pool = fleet(2, slow_ttft_factor=3.0, slow_min_extra_s=0.5)
    for i in range(10):
        pool[0].record_ttfb(0.001, now=i)
        pool[1].record_ttfb(0.05, now=i)  # 50x, but only 49 ms more
    assert not pool[1].slow


def test_down_listeners_hear_of_the_transition_once() -> None:
    (r,) = fleet(1, unhealthy_threshold=1)
    heard: list[int] = []
    handle = r.on_down(lambda: heard.append(1))
    r.record_probe(False, "x", now=1.0)
    r.record_probe(False, "x", now=2.0)
    assert heard == [1]
    r.off_down(handle)
    r.record_probe(True, now=3.0)
    r.record_probe(False, "x", now=4.0)
    assert heard == [1]


def test_slow_is_judged_within_the_pools_a_replica_serves() -> None:
    """Two routes: a big model's pool (r0, r1) is slower than a small model's (r2, r3) by
    nature; neither is slow — but a replica far behind its own pool is."""
    pool = fleet(4, pools=[[0, 1], [2, 3]], slow_ttft_factor=3.0, slow_min_extra_s=0.5)
    for i in range(10):
        for r, ttfb in zip(pool, (3.0, 3.2, 0.1, 0.1), strict=True):
            r.record_ttfb(ttfb, now=i)
    assert [r.slow for r in pool] == [False, False, False, False]
    for i in range(20):
        pool[1].record_ttfb(12.0, now=20 + i)
    assert [r.slow for r in pool] == [False, True, False, False]
