"""The prefix-affinity index: longest match, bounded memory, LRU decay."""

from __future__ import annotations

import random

import pytest

from gateway.routing.affinity import AffinityIndex


def chain(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.getrandbits(64) for _ in range(n)]


def test_longest_match_per_replica() -> None:
    index = AffinityIndex(10_000)
    head = chain(8, 1)
    a = head + chain(10, 2)
    b = head + chain(4, 3)
    index.record("A", a)
    index.record("B", b)
    assert index.match(a, ["A", "B", "C"]) == {"A": 18, "B": 8}
    assert index.match(head + chain(5, 9), ["A", "B"]) == {"A": 8, "B": 8}
    assert index.match(a, ["B"]) == {"B": 8}, "only the replicas asked about"
    assert index.match(chain(5, 4), ["A", "B"]) == {}


def test_growing_conversation_finds_its_previous_turn_with_stride() -> None:
    index = AffinityIndex(10_000, stride=4)
    turn1 = chain(13, 5)  # deepest index 12 is not a multiple of the stride: still stored
    index.record("A", turn1)
    turn2 = turn1 + chain(7, 6)
    assert index.match(turn2, ["A"]) == {"A": 13}
    # A different continuation after block 9 matches the last stored stride key (block 8).
    assert index.match(turn1[:9] + chain(5, 7), ["A"]) == {"A": 8}


def test_memory_is_bounded_and_old_tails_go_first() -> None:
    index = AffinityIndex(max_entries=40)
    index.set_members(["A", "B"])
    assert index.capacity() == 20
    head = chain(5, 10)
    for i in range(30):
        index.record("A", head + chain(5, 100 + i))
    assert index.entries("A") <= 20 and index.entries() <= 40
    # The shared head is touched by every request, so it survives while old tails are evicted.
    assert index.match(head, ["A"]) == {"A": 5}
    assert index.match(head + chain(5, 100), ["A"]) == {"A": 5}
    assert index.match(head + chain(5, 129), ["A"]) == {"A": 10}


def test_replica_capacity_models_a_small_cache() -> None:
    index = AffinityIndex(max_entries=1000, replica_capacity=12)
    for i in range(10):
        index.record("A", chain(6, i))
    assert index.entries("A") == 12
    assert index.match(chain(6, 0), ["A"]) == {}
    assert index.match(chain(6, 9), ["A"]) == {"A": 6}


def test_forget_and_set_members() -> None:
    index = AffinityIndex(100)
    keys = chain(4, 1)
    index.record("A", keys)
    index.record("B", keys)
    assert index.holders(keys[0]) == ["A", "B"]
    index.set_members(["B", "C"])
    assert index.holders(keys[0]) == ["B"]
    assert index.match(keys, ["A", "B"]) == {"B": 4}
    index.forget("B")
    assert len(index) == 0
    index.record("D", keys)  # slots are reused deterministically
    assert index.match(keys, ["D"]) == {"D": 4}


def test_memory_stays_within_its_byte_bound_under_a_million_distinct_prompts() -> None:
    bound = 8 * 1024 * 1024
    index = AffinityIndex(stride=4, max_bytes=bound)
    names = [f"r{i}" for i in range(4)]
    index.set_members(names)
    rnd = random.Random(7)
    head = chain(8, 3)  # every prompt shares a head, then its own deepest key (as stored: deepest first)
    stored_head = index.stored_keys(head)
    record = index.record_stored
    worst = 0
    for i in range(1_000_000):
        record(names[i & 3], [rnd.getrandbits(64), *stored_head], 5_000 + i)
        if i % 250_000 == 249_999:
            worst = max(worst, index.memory_bytes())
    assert worst <= bound, worst
    assert index.entries() > 0.6 * bound / index.entry_bytes()  # the bound is used, not wasted
    assert index.match([*head, 1], names) == dict.fromkeys(names, 8)  # the shared head survives


def test_memory_bytes_is_honest() -> None:
    """``memory_bytes`` (what the bound is checked against) is at least what tracemalloc sees."""
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = AffinityIndex(stride=1, max_bytes=4 * 1024 * 1024)
        index.set_members(["a", "b", "c"])
        rnd = random.Random(1)
        for i in range(30_000):
            index.record(["a", "b", "c"][i % 3], [rnd.getrandbits(64) for _ in range(3)], 9_000)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert used * 0.9 <= index.memory_bytes() <= 4 * 1024 * 1024, (used, index.memory_bytes())


def test_unrecord_takes_back_only_what_a_record_added() -> None:
    index = AffinityIndex(1000)
    index.set_members(["a", "b"])
    index.record("a", [1, 2])
    added = index.record("a", [1, 2, 3, 4])
    assert added == [4, 3]  # deepest first; 1 and 2 were already held
    index.record("b", [1, 2, 3])
    index.unrecord("a", added)
    assert index.match([1, 2, 3, 4], ["a", "b"]) == {"a": 2, "b": 3}
    assert index.holders(3) == ["b"] and index.holders(4) == []


def _full_scan(index: AffinityIndex, keys: tuple[int, ...], names: list[str]) -> dict[str, int]:
    """Depth per replica by probing every key (what match_groups skips most of)."""
    depth: dict[str, int] = {}
    for name in names:
        for i in range(len(keys) - 1, -1, -1):
            if name in index.holders(keys[i]):
                depth[name] = i + 1
                break
    return depth


@pytest.mark.parametrize("stride", [1, 2, 3, 4])
def test_probing_stride_keys_finds_what_probing_every_key_finds(stride: int) -> None:
    """Records, failed attempts taken back, replicas leaving, LRU eviction and peers' records:
    the deepest match of every replica is the same as a probe of every key would find."""
    rnd = random.Random(stride)
    names = [f"r{i}" for i in range(6)]
    index = AffinityIndex(None, stride, 40, max_bytes=1 << 24)
    index.set_members(names)
    heads = [tuple(rnd.getrandbits(64) for _ in range(rnd.randint(1, 9))) for _ in range(4)]
    prompts = [rnd.choice(heads) + tuple(rnd.getrandbits(64) for _ in range(rnd.randint(0, 12))) for _ in range(30)]
    for step in range(1500):
        action = rnd.random()
        prompt = rnd.choice(prompts)
        if action < 0.25:  # a conversation's next turn
            grown = prompt + tuple(rnd.getrandbits(64) for _ in range(rnd.randint(1, 6)))
            prompts[prompts.index(prompt)] = grown
            prompt = grown
        name = rnd.choice(names)
        if action < 0.7:
            added = index.record(name, prompt, rnd.choice([None, 5000]))
            if rnd.random() < 0.15:
                index.unrecord(name, added)  # the attempt failed before an answer
        elif action < 0.8:
            index.record_stored(name, index.stored_keys(prompt[: rnd.randint(1, len(prompt))]))  # a peer's
        elif action < 0.82:
            index.set_members([n for n in names if n != name])  # it left ...
            index.set_members(names)  # ... and came back empty
        probe = rnd.choice(prompts)[: rnd.randint(1, 30)] + tuple(rnd.getrandbits(64) for _ in range(rnd.randint(0, 3)))
        assert index.match(probe, None) == _full_scan(index, probe, names), step
