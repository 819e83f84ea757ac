"""Baseline policies as pure functions of (request, replicas), and the registry."""

from __future__ import annotations

import collections

import pytest
from pydantic import ValidationError

from gateway.routing import registry
from gateway.routing.base import ReplicaView, RequestView
from gateway.routing.policies.least_loaded import LeastLoadedSettings
from gateway.routing.policies.session import SessionSettings, rendezvous_order


def req(session: str | None = None) -> RequestView:
    return RequestView("rid", "route", "m", "chat", session_key=session)


def views(*loads: int, weights: tuple[float, ...] | None = None) -> list[ReplicaView]:
    weights = weights or tuple(1.0 for _ in loads)
    return [ReplicaView(f"r{i}", w, n) for i, (n, w) in enumerate(zip(loads, weights, strict=True))]


def build(name: str, members: list[ReplicaView], **settings: object):
    return registry.build_policy(name, settings, members)


def test_registry_lists_baseline_policies_and_rejects_unknown() -> None:
    assert {"round_robin", "random", "least_loaded", "session"} <= set(registry.policy_names())
    with pytest.raises(KeyError, match="valid policies"):
        registry.entry("nope")
    with pytest.raises(ValidationError):
        registry.validate_settings("least_loaded", {"unknown": 1})
    assert not registry.entry("least_loaded").needs_prefix_keys


def test_round_robin_cycles_and_respects_weights() -> None:
    members = views(0, 0, 0)
    policy = build("round_robin", members)
    picks = [policy.choose(req(), members).replica for _ in range(9)]
    assert collections.Counter(picks) == {"r0": 3, "r1": 3, "r2": 3}
    assert picks[:3] == sorted(set(picks[:3]))  # interleaved, not bursts
    weighted = views(0, 0, weights=(3.0, 1.0))
    policy = build("round_robin", weighted)
    picks = [policy.choose(req(), weighted).replica for _ in range(8)]
    assert collections.Counter(picks) == {"r0": 6, "r1": 2}
    assert all(policy.choose(req(), weighted).reason == "round_robin" for _ in range(2))


def test_round_robin_skips_missing_replica_evenly() -> None:
    members = views(0, 0, 0)
    policy = build("round_robin", members)
    eligible = [members[0], members[2]]
    picks = [policy.choose(req(), eligible).replica for _ in range(10)]
    assert collections.Counter(picks) == {"r0": 5, "r2": 5}


def test_random_spreads_and_is_reproducible_with_seed() -> None:
    members = views(0, 0, 0, 0)
    a = build("random", members, seed=1)
    b = build("random", members, seed=1)
    picks_a = [a.choose(req(), members).replica for _ in range(400)]
    picks_b = [b.choose(req(), members).replica for _ in range(400)]
    assert picks_a == picks_b
    counts = collections.Counter(picks_a)
    assert set(counts) == {"r0", "r1", "r2", "r3"}
    assert min(counts.values()) > 60


def test_least_loaded_picks_min_per_weight_and_rotates_ties() -> None:
    policy = build("least_loaded", views(0, 0, 0))
    assert policy.choose(req(), views(3, 1, 2)).replica == "r1"
    assert policy.choose(req(), views(4, 3, weights=(4.0, 1.0))).replica == "r0"  # 1.0 < 3.0 per weight
    tied = views(0, 0, 0)
    picks = {policy.choose(req(), tied).replica for _ in range(3)}
    assert picks == {"r0", "r1", "r2"}  # not always the first one


def test_least_loaded_can_count_engine_queue() -> None:
    members = [ReplicaView("a", 1.0, 1, num_waiting=10), ReplicaView("b", 1.0, 2, num_waiting=0)]
    plain = registry.build_policy("least_loaded", LeastLoadedSettings(), members)
    queued = registry.build_policy("least_loaded", LeastLoadedSettings(count_engine_waiting=True), members)
    assert plain.choose(req(), members).replica == "a"
    assert queued.choose(req(), members).replica == "b"


def test_session_pins_keys_and_falls_back_without_header() -> None:
    members = views(0, 0, 0, 0)
    policy = build("session", members)
    for key in ("alice", "bob", "carol"):
        first = policy.choose(req(key), members)
        assert first.reason == "session"
        assert all(policy.choose(req(key), members).replica == first.replica for _ in range(5))
    homes = {policy.choose(req(f"user-{i}"), members).replica for i in range(200)}
    assert homes == {"r0", "r1", "r2", "r3"}
    assert policy.choose(req(None), members).reason == "fallback"


def test_session_moves_only_keys_of_a_removed_replica() -> None:
    members = views(0, 0, 0, 0)
    policy = build("session", members)
    before = {f"k{i}": policy.choose(req(f"k{i}"), members).replica for i in range(400)}
    without = [m for m in members if m.name != "r2"]
    after = {k: policy.choose(req(k), without).replica for k in before}
    moved = [k for k in before if before[k] != after[k]]
    assert moved and all(before[k] == "r2" for k in moved)


def test_session_load_bound_spills_to_next_choice() -> None:
    members = views(0, 0, 0, weights=None)
    order = rendezvous_order("s", members)
    home = order[0].name
    loaded = [ReplicaView(m.name, 1.0, 10 if m.name == home else 0) for m in members]
    strict = registry.build_policy("session", SessionSettings(), members)
    bounded = registry.build_policy("session", SessionSettings(max_load_factor=1.25), members)
    assert strict.choose(req("s"), loaded).replica == home
    spilled = bounded.choose(req("s"), loaded)
    assert spilled.reason == "spill" and spilled.replica == order[1].name
