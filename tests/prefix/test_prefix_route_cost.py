"""The route stage does not pass over the fleet: a decision on 256 replicas reads a handful of
them, and still picks what a full pass would (least busy, ties in ring order, the bound)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gateway.config import HealthSettings, ReplicaConfig
from gateway.replicas.pool import Replica
from gateway.routing.base import RequestView
from gateway.routing.policies import prefix_fleet
from gateway.routing.policies.prefix import PrefixPolicy, PrefixPolicySettings
from gateway.routing.ring import HashRing
from gateway.routing.runner import LiveReplicaView, PolicyRunner
from tests.prefix.policy_helpers import chain

N = 256


def fleet(n: int = N) -> list[Replica]:
    return [Replica(ReplicaConfig(name=f"v{i}", url=f"http://h:{i + 1}"), None, HealthSettings())  # type: ignore[arg-type]
            for i in range(n)]  # fmt: skip


def runner_for(pool: list[Replica], **settings: object) -> PolicyRunner:
    policy = PrefixPolicy(PrefixPolicySettings(**settings), [r.view() for r in pool])  # type: ignore[arg-type]
    return PolicyRunner("route", "prefix", policy, pool)


def req(keys: tuple[int, ...], rid: str = "x") -> RequestView:
    return RequestView(rid, "route", "m", "chat", None, keys, 16, len(keys) * 16 + 3, len(keys) * 16 + 3)


@contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Count reads of a replica's counters through the views, and per-replica load checks."""
    counts = {"view_reads": 0, "replica_checks": 0}
    view_in_flight = LiveReplicaView.in_flight
    admitted = prefix_fleet.DecisionFleet.admitted

    def read(self: LiveReplicaView) -> int:
        counts["view_reads"] += 1
        return view_in_flight.fget(self)  # type: ignore[attr-defined, no-any-return]

    def checked(self: prefix_fleet.DecisionFleet, slot: int, group: prefix_fleet.Group) -> bool:
        counts["replica_checks"] += 1
        return admitted(self, slot, group)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LiveReplicaView, "in_flight", property(read))
        mp.setattr(prefix_fleet.DecisionFleet, "admitted", checked)
        yield counts


@pytest.mark.parametrize("busy", [0, 6])
def test_a_decision_on_256_replicas_reads_a_handful_of_them(busy: int) -> None:
    """Idle (every replica ties) and busy (random load): no view is read, and the replicas whose
    load is checked are a few — a full pass would check all 256 on every request."""
    rnd = random.Random(busy)
    pool = fleet()
    runner = runner_for(pool)
    heads = [chain(8, 100 + i) for i in range(4)]
    convs = [heads[i % 4] + chain(20, i) for i in range(40)]
    for i in range(200):  # warm: conversations, shared heads and cold prompts placed
        keys = convs[i % 40] if i % 3 else chain(24, 10_000 + i)
        runner.decide(req(keys, f"w{i}"))
    worst = 0
    with counting() as counts:
        for i in range(200):
            for r in pool:
                r.in_flight = rnd.randint(0, busy)
            before = counts["replica_checks"]
            kinds = (convs[i % 40] + chain(2, i), heads[i % 4] + chain(6, i), chain(24, i))
            keys = kinds[i % 3]  # a conversation's next turn, a new one behind a head, a cold prompt
            runner.decide(req(keys, f"q{i}"))
            worst = max(worst, counts["replica_checks"] - before)
    assert counts["view_reads"] == 0
    assert worst <= 40, f"a decision checked {worst} of {N} replicas"


def test_an_idle_fleet_sends_new_prompts_to_their_ring_owner() -> None:
    """Every replica idle: all tie, and the request's own key's ring order decides — found by
    a short walk, the same replica a scan over all 256 would find."""
    pool = fleet()
    runner = runner_for(pool)
    ring: HashRing = runner.policy.ring  # type: ignore[attr-defined]
    names = [r.name for r in pool]
    for i in range(50):
        keys = chain(20, 5_000 + i)
        decision, _ = runner.decide(req(keys, f"c{i}"))
        assert decision.replica == ring.first(keys[15], names)  # key_depth_tokens 256 -> block 16
        assert decision.reason == "ring"


def test_ties_among_the_least_busy_follow_the_ring_and_the_bound_holds() -> None:
    rnd = random.Random(7)
    pool = fleet()
    runner = runner_for(pool)
    ring: HashRing = runner.policy.ring  # type: ignore[attr-defined]
    for i in range(100):
        loads = [rnd.choice([0, 1, 1, 2, 3, 40]) if rnd.random() < 0.9 else 0 for _ in pool]
        least = min(loads)
        for r, f in zip(pool, loads, strict=True):
            r.in_flight = f
        keys = chain(20, 9_000 + i)
        decision, _ = runner.decide(req(keys, f"t{i}"))
        expected = ring.first(keys[15], [r.name for r, f in zip(pool, loads, strict=True) if f == least])
        assert decision.replica == expected


def test_pure_chwbl_walks_the_ring_to_the_first_replica_under_its_bound() -> None:
    pool = fleet()
    runner = runner_for(pool, ring_slack=None, load_factor=1.25)
    ring: HashRing = runner.policy.ring  # type: ignore[attr-defined]
    rnd = random.Random(3)
    for i in range(60):
        loads = [rnd.randint(0, 8) for _ in pool]
        for r, f in zip(pool, loads, strict=True):
            r.in_flight = f
        bound = -(-int(1.25 * (sum(loads) + 1) * 1000) // (N * 1000))  # ceil(c x (total + 1) / n)
        keys = chain(20, 7_000 + i)
        decision, _ = runner.decide(req(keys, f"p{i}"))
        assert decision.replica == next(n for n in ring.walk(keys[15]) if loads[int(n[1:])] < bound)


def test_ring_first_where_agrees_with_first_and_respects_its_budget() -> None:
    rnd = random.Random(1)
    ring = HashRing({f"m{i}": rnd.choice([0.5, 1.0, 2.0]) for i in range(60)}, 40)
    members = ring.members
    for _ in range(300):
        subset = set(rnd.sample(members, rnd.randint(1, 60)))
        key = rnd.getrandbits(64)
        assert ring.first_where(key, subset.__contains__, 10**9) == ring.first(key, subset)
    assert ring.first_where(5, lambda name: False, 10**9) is None
    assert ring.first_where(5, lambda name: name == members[0], 1) in (None, members[0])


def test_a_head_held_by_every_replica_is_one_group_not_256_replicas() -> None:
    """A tenant's system prompt cached on the whole fleet: a new conversation behind it still
    reads a handful of replicas, and goes to the least busy holder (ties by its own key)."""
    rnd = random.Random(5)
    pool = fleet()
    runner = runner_for(pool)
    ring: HashRing = runner.policy.ring  # type: ignore[attr-defined]
    head = chain(40, 1)
    for i, r in enumerate(pool):
        runner.policy.index.record(r.name, head + chain(10, 100 + i))  # type: ignore[attr-defined]
    with counting() as counts:
        for i in range(100):
            loads = [rnd.randint(1, 6) for _ in pool]
            for r, f in zip(pool, loads, strict=True):
                r.in_flight = f
            before = counts["replica_checks"]
            keys = head + chain(30, 1000 + i)
            decision, _ = runner.decide(req(keys, f"h{i}"))
            assert counts["replica_checks"] - before <= 40
            least = [r.name for r, f in zip(pool, loads, strict=True) if f == min(loads)]
            assert decision.replica == ring.first(keys[-1], least)
    assert counts["view_reads"] == 0
