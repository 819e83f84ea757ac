"""The prefix-affinity index: longest match, bounded memory, LRU decay."""

from __future__ import annotations

import random
from itertools import pairwise

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


def test_a_modelled_kv_cache_evicts_by_tokens_oldest_first() -> None:
    index = AffinityIndex(max_entries=1000)
    index.set_token_capacity("A", 12 * 16)  # 12 blocks of 16 tokens
    for i in range(10):
        index.record("A", chain(6, i), tokens_at=lambda d: 16 * d)
    assert index.entries("A") == 12 and index.tokens_held("A") == 12 * 16
    assert index.match(chain(6, 0), ["A"]) == {}
    assert index.match(chain(6, 9), ["A"]) == {"A": 6}


def test_sparse_keys_weigh_the_tokens_they_cover() -> None:
    """Past the token window a key covers ~1,000 tokens: a long prompt fills the modelled
    cache by its tokens, not by its (few) keys."""
    index = AffinityIndex(max_entries=10_000, stride=4)
    index.set_token_capacity("A", 40_000)

    def tokens_at(depth: int) -> int:  # 256 blocks of 16 tokens, then ~256 tokens per text key
        return 16 * depth if depth <= 256 else 4096 + 256 * (depth - 256)

    first = chain(256 + 112, 1)  # a 32.8k-token prompt: 92 stored keys
    index.record("A", first, 32_800, tokens_at)
    assert index.entries("A") == 92 and index.tokens_held("A") == 32_800
    second = chain(256 + 112, 2)
    index.record("A", second, 32_800, tokens_at)
    # Both would fit as keys (184 of 10,000); as tokens only one does.
    assert index.tokens_held("A") <= 40_000
    assert index.match(second, ["A"]) == {"A": 368}
    # Of the first prompt only the head fits beside it (a request frees its tail first).
    kept = index.match(first, ["A"])["A"]
    assert 4096 < tokens_at(kept) <= 40_000 - 32_800
    weight_of = index.stored_weights(9, lambda d: 16 * d, 200).weight_of  # stored at depths 9, 8, 4
    assert [weight_of(i) for i in range(3)] == [200 - 128, 64, 64]


def test_a_conversation_weighs_its_tokens_once_however_many_turns() -> None:
    """Each turn's deepest key also carries the text past its keys; the next turn's keys cover
    that text, so the modelled cache must not count it again (8 turns would count 7 tails
    twice and evict the conversation's head early)."""
    index = AffinityIndex(max_entries=10_000, stride=4)
    index.default_weight = 64
    index.set_token_capacity("A", 1_000_000)

    def tokens_at(depth: int) -> int:  # 256 blocks of 16 tokens, then 250 tokens per text key
        return 16 * depth if depth <= 256 else 4096 + 250 * (depth - 256)

    history = chain(256 + 80, 3)
    for turn in range(8):
        keys = history[: 256 + 20 + 8 * turn]
        index.record("A", keys, tokens_at(len(keys)) + 300, tokens_at, (256, 16))
    assert index.tokens_held("A") == tokens_at(len(keys)) + 300  # the last turn's prompt, once


def test_token_capacity_applies_to_keys_recorded_before_and_from_peers() -> None:
    index = AffinityIndex(max_entries=1000, stride=2)
    index.default_weight = 32
    for i in range(10):
        index.record("A", chain(4, i))  # 2 stored keys each, unweighted: no cap yet
    assert index.entries("A") == 20
    index.set_token_capacity("A", 6 * 32)  # each known key weighs a stride of blocks
    assert index.entries("A") == 6 and index.tokens_held("A") == 6 * 32
    index.record_stored("A", index.stored_keys(chain(4, 50)))  # a peer's record: default weights
    assert index.tokens_held("A") == 6 * 32 and index.match(chain(4, 50), ["A"]) == {"A": 4}
    added = index.record("A", chain(4, 60), tokens_at=lambda d: 100 * d)
    assert index.tokens_held("A") <= 6 * 32
    index.unrecord("A", added)  # a failed attempt gives its tokens back
    assert index.match(chain(4, 60), ["A"]) == {}
    index.set_token_capacity("B", 10_000)
    index.record_stored("B", index.stored_keys(chain(4, 70)), 5_000)  # a peer's long prompt
    assert index.tokens_held("B") == 5_000  # its length past the keys sits on its deepest key
    index.set_token_capacity("A", None)
    assert index.tokens_held("A") is None and index.token_capacity("A") is None
    index.forget("A")
    assert index.entries("A") == 0 and index.entries() == 2


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


@pytest.mark.slow
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


@pytest.mark.parametrize("modelled", [False, True])
@pytest.mark.slow
def test_memory_bytes_is_honest(modelled: bool) -> None:
    """``memory_bytes`` (what the bound is checked against) is at least what tracemalloc sees,
    with and without a KV cache model (which keeps a weight per key)."""
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = AffinityIndex(stride=1, max_bytes=4 * 1024 * 1024)
        index.set_members(["a", "b", "c"])
        if modelled:
            for name in ("a", "b", "c"):
                index.set_token_capacity(name, 10**9)  # the byte bound, not the cache, decides
        rnd = random.Random(1)
        for i in range(30_000):
            index.record(["a", "b", "c"][i % 3], [rnd.getrandbits(64) for _ in range(3)], 9_000, lambda d: 3_000 * d)
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
    """Records, failed attempts taken back, replicas leaving, LRU eviction (by keys, and by
    tokens on replicas whose KV cache is modelled) and peers' records: the deepest match of
    every replica is the same as a probe of every key would find."""
    rnd = random.Random(stride)
    names = [f"r{i}" for i in range(6)]
    index = AffinityIndex(6 * 40, stride, max_bytes=1 << 24)
    index.set_members(names)
    for name in names[:3]:
        index.set_token_capacity(name, 16 * 25)
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
            added = index.record(name, prompt, rnd.choice([None, 5000]), lambda d: 16 * d)
            if rnd.random() < 0.15:
                index.unrecord(name, added)  # the attempt failed before an answer
        elif action < 0.8:
            index.record_stored(name, index.stored_keys(prompt[: rnd.randint(1, len(prompt))]))  # a peer's
        elif action < 0.82:
            index.set_members([n for n in names if n != name])  # it left ...
            index.set_members(names)  # ... and came back empty
            if name in names[:3]:
                index.set_token_capacity(name, 16 * 25)
        probe = rnd.choice(prompts)[: rnd.randint(1, 30)] + tuple(rnd.getrandbits(64) for _ in range(rnd.randint(0, 3)))
        assert index.match(probe, None) == _full_scan(index, probe, names), step
        for capped in names[:3]:
            held = index.tokens_held(capped)
            assert held is not None and 0 <= held <= 16 * 25, step


def _past_ten_blocks(depth: int) -> int:
    """Ten token blocks of 16, then text keys of ~100 tokens."""
    return 16 * depth if depth <= 10 else 160 + 100 * (depth - 10)


@pytest.mark.parametrize("stride", [1, 2, 3, 4, 5])
def test_stored_weights_are_the_tokens_between_stored_keys(stride: int) -> None:
    index = AffinityIndex(100, stride=stride)

    def tokens_at(depth: int) -> int:  # any increasing token count
        return depth * depth + 3 * depth

    for depth in range(1, 40):
        weight_of = index.stored_weights(depth, tokens_at, tokens_at(depth) + 7).weight_of
        depths = [*range(stride, depth + 1, stride), *([depth] if depth % stride else [])]
        bounds = [0, *depths]
        expected = [tokens_at(b) - tokens_at(a) if a else tokens_at(b) for a, b in pairwise(bounds)]
        expected[-1] += 7  # the deepest carries the prompt past its keys
        stored = index.stored_keys(list(range(depth)))
        assert [weight_of(i) for i in range(len(stored))] == expected[::-1]
        # the first keys declared whole token blocks: the same weights (computed there without tokens_at)
        index.default_weight = 16 * stride  # what the policy sets: a stride of 16-token blocks
        linear = index.stored_weights(depth, _past_ten_blocks, None, (10, 16))
        plain = index.stored_weights(depth, _past_ten_blocks, None).weight_of
        weights = [plain(i) for i in range(len(stored))]
        assert [linear.weight_of(i) for i in range(len(stored))] == weights
        # past the first `special` keys every weight is the standard one (recorded without a call)
        assert all(w == 16 * stride for w in weights[linear.special :])
        index.default_weight = stride


def test_a_match_between_stored_keys_is_judged_by_the_deepest_stored_key_below_it() -> None:
    index = AffinityIndex(10_000, stride=4)
    head = chain(13, 11)  # a shared head whose end (13) is no stride key
    for seed in (12, 13):  # two conversations went on from it differently
        index.record("A", head + chain(9, seed))
    assert index.is_fork(head[11])  # block 12, the stride key both share
    assert not index.is_fork(head[12])  # the head's exact end was never stored: it says nothing
    # A match ending at the head's exact end (as the engine's word does) is a shared head ...
    assert index.forks_at(head, 13)
    # ... and a conversation's own history is not, even where the match runs a block past
    # its deepest stored key (the engine cached a block of the reply).
    own = chain(21, 14)
    index.record("A", own)
    assert not index.forks_at(own + chain(3, 15), 22)
    assert not index.forks_at(chain(5, 16), 5)  # nothing stored: no fork
