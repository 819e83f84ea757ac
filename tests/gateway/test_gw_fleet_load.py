"""The runner's live fleet load stays equal to a fresh snapshot through every kind of change."""

from __future__ import annotations

import gc
import random

from gateway.config import HealthSettings, ReplicaConfig
from gateway.replicas.pool import Replica
from gateway.routing.base import ReplicaView, RequestView
from gateway.routing.load import FleetLoad, FleetViews, fleet_load
from gateway.routing.runner import PolicyRunner
from tests.gateway.test_gw_runner import REQ, Recording

ORDERS = [(1.0, 0.0), (64.0, 1.0), (1.0, 1 / 64), (0.0, 1.0)]


def pool_of(weights: list[float]) -> list[Replica]:
    return [Replica(ReplicaConfig(name=f"r{i}", url=f"http://h:{i + 1}", weight=w), None, HealthSettings())  # type: ignore[arg-type]
            for i, w in enumerate(weights)]  # fmt: skip


def assert_matches_snapshot(load: FleetLoad, eligible: list[Replica]) -> None:
    fresh = FleetLoad.of([r.view() for r in eligible])
    assert load.names == fresh.names
    assert (load.in_flight, load.pending) == (fresh.in_flight, fresh.pending)
    assert load.total_in_flight == fresh.total_in_flight and load.weight_sum == fresh.weight_sum
    for a, b in ORDERS:
        kept, built = load.order(a, b), fresh.order(a, b)
        assert kept.entries == built.entries == sorted(kept.entries)
        assert kept.keys == built.keys


def test_live_load_follows_acquire_release_peers_pending_and_direct_writes() -> None:
    rnd = random.Random(3)
    pool = pool_of([1.0, 2.0, 1.0, 0.5, 1.0, 3.0])
    runner = PolicyRunner("route", "recording", Recording(), pool)
    load = runner._first_attempt().views.load
    for a, b in ORDERS:  # orders asked for before the changes are kept up to date
        load.order(a, b)
    held = []
    for step in range(400):
        r = rnd.choice(pool)
        action = rnd.randrange(6)
        if action == 0:
            request = RequestView("x", "route", "m", "chat", prompt_tokens_estimate=rnd.randint(1, 5000))
            decision, replica = runner.decide(request)
            held.append((replica, request, decision, runner.acquire(replica, request, decision)))
        elif action == 1 and held:
            replica, request, decision, charged = held.pop(rnd.randrange(len(held)))
            runner.prefill_done(replica, charged)
            runner.release(replica, request, decision, None, completed=True)
        elif action == 2:
            r.peer_in_flight = rnd.randint(0, 9)
        elif action == 3:
            r.peer_pending_prefill_tokens = rnd.randint(0, 9000)
        elif action == 4:
            r.in_flight += rnd.randint(0, 3)  # written directly (a benchmark, a test)
        else:
            r.pending_prefill_tokens = rnd.randint(0, 4000)
        assert runner._first_attempt().views.load is load
        if step % 25 == 0:
            assert_matches_snapshot(load, pool)


def test_health_and_slow_changes_rebuild_the_eligible_set_and_its_load() -> None:
    pool = pool_of([1.0] * 5)
    policy = Recording()
    runner = PolicyRunner("route", "recording", policy, pool)
    first = runner._first_attempt()
    assert runner._first_attempt() is first  # kept between events
    pool[1].in_flight = 4
    pool[2].healthy = False
    runner.decide(REQ)
    views = policy.seen[-1]
    assert [v.name for v in views] == ["r0", "r1", "r3", "r4"]
    load = runner._first_attempt().views.load
    assert load.total_in_flight == 4 and load.names == ["r0", "r1", "r3", "r4"]
    pool[2].in_flight = 7  # not eligible: not counted
    assert load.total_in_flight == 4
    pool[2].healthy = True
    runner.decide(REQ)
    assert runner._first_attempt().views.load.total_in_flight == 11
    pool[4].slow = True
    runner.decide(REQ)
    assert [v.name for v in policy.seen[-1]] == ["r0", "r1", "r2", "r3"]
    assert_matches_snapshot(runner._first_attempt().views.load, pool[:4])


def test_membership_changes_move_the_watch() -> None:
    pool = pool_of([1.0] * 4)
    runner = PolicyRunner("route", "recording", Recording(), pool)
    runner.set_replicas(pool[:2])
    load = runner._first_attempt().views.load
    pool[3].in_flight = 5  # left the pool: no longer watched
    pool[0].in_flight = 2
    assert load.names == ["r0", "r1"] and load.total_in_flight == 2


def test_a_replaced_runner_stops_watching() -> None:
    """A config reload builds new runners over the same replicas: the old ones must not be
    told of every change forever."""
    pool = pool_of([1.0] * 2)
    runner = PolicyRunner("route", "recording", Recording(), pool)
    runner._first_attempt()
    del runner
    gc.collect()
    pool[0].in_flight = 1
    assert all(ref() is None for ref in pool[0]._watchers)
    PolicyRunner("route", "recording", Recording(), pool)  # watching again prunes the dead reference
    assert len(pool[0]._watchers) == 1


def test_plain_views_get_a_snapshot_and_runner_views_their_live_load() -> None:
    views = [ReplicaView("a", 2.0, in_flight=3, pending_prefill_tokens=10), ReplicaView("b", in_flight=1)]
    snap = fleet_load(views)
    assert (snap.total_in_flight, snap.weight_sum, snap.uniform) == (4, 3.0, False)
    assert [snap.names[i] for i in snap.order(1.0, 0.0).slots()] == ["b", "a"]  # 1/1 < 3/2
    live = FleetViews(views, snap)
    assert fleet_load(live) is snap and list(live) == views


def test_the_watched_attributes_read_like_plain_ones() -> None:
    (r,) = pool_of([1.0])
    assert (r.in_flight, r.pending_prefill_tokens, r.healthy, r.slow) == (0, 0, True, False)
    r.in_flight += 3
    r.healthy = False
    assert (r.in_flight, r.healthy) == (3, False)
    assert isinstance(Replica.__dict__["in_flight"], type(Replica.in_flight))  # the class gets the descriptor
