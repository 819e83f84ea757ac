"""The consistent-hash ring and the CHWBL load bound."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.ring import HashRing, load_bounds

_RND = random.Random(7)
KEYS = [_RND.getrandbits(64) for _ in range(4000)]


def owners(ring: HashRing) -> list[str | None]:
    return [ring.owner(k) for k in KEYS]


_names = st.lists(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12), unique=True)


@settings(max_examples=40, deadline=None)
@given(_names.filter(lambda n: 3 <= len(n) <= 12), st.data())
@pytest.mark.slow
def test_removing_a_replica_moves_only_its_keys_about_1_over_n(names: list[str], data: st.DataObject) -> None:
    before = HashRing(dict.fromkeys(names, 1.0))
    gone = data.draw(st.sampled_from(names))
    after = HashRing({n: 1.0 for n in names if n != gone})
    old, new = owners(before), owners(after)
    moved = [i for i in range(len(KEYS)) if old[i] != new[i]]
    assert all(old[i] == gone for i in moved), "only the removed replica's keys move"
    assert all(new[i] != gone for i in range(len(KEYS)))
    n = len(names)
    assert len(moved) / len(KEYS) <= 1.6 / n + 0.02, "about 1/N of keys move"


@settings(max_examples=40, deadline=None)
@given(_names.filter(lambda n: 2 <= len(n) <= 12), st.text(alphabet="XYZ_", min_size=1, max_size=8))
@pytest.mark.slow
def test_adding_a_replica_moves_keys_only_to_it_about_1_over_n(names: list[str], newcomer: str) -> None:
    before = HashRing(dict.fromkeys(names, 1.0))
    after = HashRing(dict.fromkeys([*names, newcomer], 1.0))
    old, new = owners(before), owners(after)
    moved = [i for i in range(len(KEYS)) if old[i] != new[i]]
    assert all(new[i] == newcomer for i in moved), "keys only move to the new replica"
    assert len(moved) / len(KEYS) <= 1.6 / (len(names) + 1) + 0.02


@settings(max_examples=30, deadline=None)
@given(_names.filter(lambda n: 1 <= len(n) <= 10), st.integers(0, 2**64 - 1))
def test_walk_yields_every_member_once_and_is_deterministic(names: list[str], key: int) -> None:
    a = HashRing(dict.fromkeys(names, 1.0))
    b = HashRing(dict.fromkeys(reversed(names), 1.0))  # construction order does not matter
    walk = list(a.walk(key))
    assert sorted(walk) == sorted(names)
    assert walk == list(b.walk(key))
    subset = names[::2]
    assert list(a.walk(key, subset)) == [n for n in walk if n in subset]


def test_weights_are_respected() -> None:
    ring = HashRing({"big": 3.0, "small": 1.0}, virtual_nodes=200)
    share = owners(ring).count("big") / len(KEYS)
    assert 0.68 < share < 0.82


def test_bad_weights_rejected() -> None:
    with pytest.raises(ValueError):
        HashRing({"a": -1.0})
    with pytest.raises(ValueError):
        HashRing({"a": 1.0}, virtual_nodes=0)


def test_empty_ring() -> None:
    assert HashRing({}).owner(5) is None
    assert list(HashRing({}).walk(5)) == []


def test_load_bounds_textbook_formula() -> None:
    in_flight = {"a": 3, "b": 1, "c": 0, "d": 0}
    assert load_bounds(in_flight, dict.fromkeys(in_flight, 1.0), 1.25) == dict.fromkeys(
        in_flight, math.ceil(1.25 * 5 / 4)
    )
    weighted = load_bounds({"a": 0, "b": 0}, {"a": 3.0, "b": 1.0}, 1.0)
    assert weighted == {"a": 1, "b": 1}
    assert load_bounds({"a": 7, "b": 1}, {"a": 3.0, "b": 1.0}, 1.0) == {"a": 7, "b": 3}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 50), st.sampled_from([0.5, 1.0, 2.0, 3.0])), min_size=1, max_size=12),
    st.floats(1.0, 3.0),
)
@pytest.mark.slow
def test_some_replica_is_always_under_its_bound(loads: list[tuple[int, float]], c: float) -> None:
    in_flight = {f"r{i}": n for i, (n, _) in enumerate(loads)}
    weights = {f"r{i}": w for i, (_, w) in enumerate(loads)}
    bounds = load_bounds(in_flight, weights, c)
    assert any(in_flight[r] < bounds[r] for r in in_flight)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(1, 40), st.data())
@pytest.mark.slow
def test_first_of_a_subset_is_the_walks_first(key: int, members: int, data: st.DataObject) -> None:
    """``first`` (one bisect per candidate) agrees with walking the ring, for any subset."""
    names = [f"m{i}" for i in range(members)]
    weights = {n: data.draw(st.sampled_from([0.5, 1.0, 2.0])) for n in names}
    ring = HashRing(weights, virtual_nodes=data.draw(st.integers(1, 40)))
    subset = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=members, unique=True))
    assert ring.first(key, subset) == next(ring.walk(key, subset))
    assert ring.first(key, names) == ring.owner(key)
    assert ring.first(key, ["not-a-member"]) is None
