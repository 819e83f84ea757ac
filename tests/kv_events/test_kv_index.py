"""The precise index: our own keys recomputed from ``token_ids``, removals through the engine
hash map, copies, groups, clears, LoRA/salt seeds, the window cap and the byte bound."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from gateway.kv_events.decoder import decode_frames
from gateway.kv_events.index import ENTRY_BYTES, LRU_BYTES, PreciseIndex
from gateway.prefix.blocks import chain_block_keys, engine_seed
from tests.kv_events.frames import cleared, hashes_for, message, removed, stored

MODEL = "base-model"
BS = 16


def _events(*raw: object) -> list:
    return decode_frames(message(0, list(raw))).events


def _index(**kwargs: int) -> PreciseIndex:
    index = PreciseIndex(kwargs.pop("max_bytes", 1 << 24), **kwargs)
    index.add("r0", MODEL)
    index.add("r1", MODEL)
    return index


def _keys(tokens: list[int], lora: str | None = None, salt: str | None = None) -> list[int]:
    return chain_block_keys(tokens, BS, engine_seed(MODEL, lora, salt))


def test_keys_recomputed_from_token_ids_equal_the_request_side_keys_across_chained_events() -> None:
    index = _index()
    tokens = list(range(100, 100 + 5 * BS))
    hashes = hashes_for(5)
    # the engine stores 3 blocks, then 2 more chained to the third (a later step of the same prefill)
    index.apply("r0", _events(stored(hashes[:3], tokens[: 3 * BS], BS)))
    index.apply("r0", _events(stored(hashes[3:], tokens[3 * BS :], BS, parent=hashes[2])))
    keys = _keys([*tokens, 1, 2, 3])  # a partial tail block has no key on either side
    assert index.leading(keys) == {"r0": 5}
    other = tokens[: 2 * BS] + [7] * BS + tokens[3 * BS :]  # the same prompt but for block 2
    assert index.leading(_keys(other)) == {"r0": 2}  # vLLM stops at the first miss
    for blocks in range(1, 6):  # every depth, also between the probes
        assert index.leading(keys[:blocks]) == {"r0": blocks}


def test_block_removed_goes_through_the_engine_hash_map_and_copies_count() -> None:
    index = _index()
    tokens = list(range(3 * BS))
    hashes = hashes_for(3)
    index.apply("r0", _events(stored(hashes, tokens, BS)))
    index.apply("r0", _events(stored(hashes[2:], tokens[2 * BS :], BS, parent=hashes[1])))  # re-stored last block
    keys = _keys(tokens)
    index.apply("r0", _events(removed(hashes[2:])))
    assert index.leading(keys) == {"r0": 3}  # one copy left
    index.apply("r0", _events(removed(hashes[2:])))
    assert index.leading(keys) == {"r0": 2}
    index.apply("r0", _events(removed([999]), removed(hashes[:1])))
    assert index.leading(keys) == {}
    assert index.skipped["unknown_removed"] == 1
    assert index.blocks("r0") == 1  # block 1 still held: only unreachable


def test_replicas_are_separate_and_all_blocks_cleared_clears_one() -> None:
    index = _index()
    tokens = list(range(2 * BS))
    index.apply("r0", _events(stored(hashes_for(2), tokens, BS)))
    index.apply("r1", _events(stored(hashes_for(1, 77), tokens[:BS], BS)))
    keys = _keys(tokens)
    assert index.leading(keys) == {"r0": 2, "r1": 1}
    assert index.leading(keys, ["r1"]) == {"r1": 1}
    index.apply("r0", _events(cleared()))
    assert index.leading(keys) == {"r1": 1}
    assert index.blocks() == 1


def test_lora_and_cache_salt_seed_the_first_block_like_the_request_side() -> None:
    index = _index()
    tokens = list(range(2 * BS))
    event = stored(hashes_for(2), tokens, BS, lora_name="sql-lora", extra_keys=[["sql-lora", "tenant-7"], ["sql-lora"]])
    index.apply("r0", _events(event))
    assert index.leading(_keys(tokens, "sql-lora", "tenant-7")) == {"r0": 2}
    assert index.leading(_keys(tokens)) == {}
    assert index.leading(_keys(tokens, "sql-lora")) == {}
    index.apply("r1", _events(stored(hashes_for(2, 50), tokens, BS, extra_keys=[["tenant-9"], None])))
    assert index.leading(_keys(tokens, None, "tenant-9")) == {"r1": 2}


def test_only_full_attention_groups_on_the_gpu_are_indexed() -> None:
    index = _index()
    tokens = list(range(BS))
    shared_hash = hashes_for(1)
    index.apply("r0", _events(stored(shared_hash, tokens, BS, group_idx=0, kv_cache_spec_kind="full_attention")))
    index.apply("r0", _events(stored(shared_hash, tokens, BS, group_idx=1, kv_cache_spec_kind="sliding_window")))
    index.apply("r1", _events(stored(hashes_for(1, 5), tokens, BS, medium="CPU")))
    # the sliding-window group's removal of the same engine hash must not remove the full group's
    index.apply("r0", _events(removed(shared_hash, group_idx=1)))
    assert index.leading(_keys(tokens)) == {"r0": 1}
    assert index.skipped["group"] == 1 and index.skipped["medium"] == 1


def test_unchained_multimodal_and_bad_token_events_are_counted() -> None:
    index = _index()
    index.apply("r0", _events(stored(hashes_for(1), list(range(BS)), BS, parent=424242)))
    index.apply("r0", _events(stored(hashes_for(2), list(range(BS)), BS)))  # 2 hashes, 1 block of tokens
    index.apply("r0", _events(stored(hashes_for(1), [-1] * BS, BS)))  # not u32
    mm = stored(hashes_for(2, 9), list(range(2 * BS)), BS, extra_keys=[None, [["img-hash", 0]]])
    index.apply("r0", _events(mm))
    assert index.skipped["unchained"] == 1 and index.skipped["bad_tokens"] == 2 and index.skipped["multimodal"] == 1
    assert index.leading(_keys(list(range(2 * BS)))) == {"r0": 1}  # the block before the image


def test_blocks_past_the_deepest_window_are_not_indexed() -> None:
    index = _index(max_depth_tokens=4 * BS)
    tokens = list(range(6 * BS))
    hashes = hashes_for(6)
    index.apply("r0", _events(stored(hashes[:3], tokens[: 3 * BS], BS)))
    index.apply("r0", _events(stored(hashes[3:], tokens[3 * BS :], BS, parent=hashes[2])))
    assert index.blocks("r0") == 4
    assert index.leading(_keys(tokens)) == {"r0": 4}
    assert index.skipped["deep"] == 1


def test_blocks_past_the_window_are_kept_by_depth_under_its_last_key_until_evicted() -> None:
    index = _index(max_depth_tokens=4 * BS)
    tokens = list(range(9 * BS))
    hashes = hashes_for(9)
    anchor = _keys(tokens)[3]
    # the window ends inside the first event (blocks 0-4), then two more events chain past it,
    # the second from a block that is itself past the window
    index.apply("r0", _events(stored(hashes[:5], tokens[: 5 * BS], BS)))
    index.apply("r0", _events(stored(hashes[5:7], tokens[5 * BS : 7 * BS], BS, parent=hashes[4])))
    index.apply("r0", _events(stored(hashes[7:], tokens[7 * BS :], BS, parent=hashes[6])))
    assert index.reach_past("r0", anchor) == 5
    assert index.reach_past("r1", anchor) is None  # r1 does not hold the window
    # vLLM evicts a freed request's tail first: the reach shrinks from the end
    index.apply("r0", _events(removed(hashes[7:])))
    assert index.reach_past("r0", anchor) == 3
    assert index.skipped["unknown_removed"] == 0  # removals past the window are known now
    # a second continuation under the same window (it parts after block 5) keeps the deepest
    other = tokens[: 6 * BS] + [7] * 3 * BS
    index.apply("r0", _events(stored(hashes_for(3, 50), other[6 * BS :], BS, parent=hashes[5])))
    assert index.reach_past("r0", anchor) == 5
    index.apply("r0", _events(removed(hashes_for(3, 50))))
    assert index.reach_past("r0", anchor) == 3
    # a window that ends exactly at an event's parent chains past it too
    index.apply("r0", _events(removed(hashes[4:7])))
    assert index.reach_past("r0", anchor) == 0
    index.apply("r0", _events(stored(hashes[4:6], tokens[4 * BS : 6 * BS], BS, parent=hashes[3])))
    assert index.reach_past("r0", anchor) == 2
    index.apply("r0", _events(cleared()))
    assert index.reach_past("r0", anchor) is None and index.memory_bytes() == 2 * 2048


def test_blocks_past_the_window_count_against_the_byte_bound_and_go_first() -> None:
    from gateway.kv_events.deep import DEEP_BYTES

    index = _index(max_depth_tokens=2 * BS, max_bytes=2 * 2048 + 4 * ENTRY_BYTES + 5 * DEEP_BYTES)
    tokens = list(range(14 * BS))
    hashes = hashes_for(14)
    index.apply("r0", _events(stored(hashes, tokens, BS)))  # 2 in the window, 12 past it: over the bound
    assert index.memory_bytes() <= index.max_bytes
    assert index.blocks("r0") == 2  # the window's blocks stay ...
    # ... and what was past it went: no bound now (not "none held", which would cap predictions)
    assert index.reach_past("r0", _keys(tokens)[1]) is None
    index.apply("r0", _events(cleared()))  # the engine's cache is empty: known again from here
    index.apply("r0", _events(stored(hashes[:3], tokens[: 3 * BS], BS)))
    assert index.reach_past("r0", _keys(tokens)[1]) == 1


def test_a_replica_without_its_base_model_keys_nothing_and_says_why() -> None:
    index = PreciseIndex(1 << 20)
    index.add("r9")
    index.apply("r9", _events(stored(hashes_for(1), list(range(BS)), BS)))
    assert index.blocks() == 0 and index.skipped["no_model"] == 1


def test_memory_stays_under_the_byte_bound_by_evicting_the_biggest_replicas_oldest() -> None:
    bound = 200 * ENTRY_BYTES + 2 * 2048
    index = _index(max_bytes=bound)
    for i in range(50):
        tokens = [i] * (4 * BS)
        index.apply("r0", _events(stored(hashes_for(4, 10_000 + 10 * i), tokens, BS)))
        assert index.memory_bytes() <= bound
    index.apply("r1", _events(stored(hashes_for(4, 999_999), list(range(4 * BS)), BS)))
    assert index.memory_bytes() <= bound and index.evicted > 0
    assert index.leading(_keys(list(range(4 * BS)))) == {"r1": 4}  # the small replica kept its newest
    assert index.leading(_keys([49] * (4 * BS)), ["r0"]) == {"r0": 4}  # r0 kept its newest


@pytest.mark.parametrize("track_lru", [False, True])
def test_entry_bytes_covers_what_the_structures_really_hold(track_lru: bool) -> None:
    index = _index(max_bytes=1 << 30, max_depth_tokens=1 << 20)
    index.track_lru = track_lru  # the projection's clock: a stamp per key
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    n = 0
    for i in range(400):
        tokens = [(i * 64 + j) % 50_000 for j in range(8 * BS)]
        events = _events(stored(hashes_for(8, 100_000 + 8 * i), tokens, BS))
        index.apply("r0" if i % 2 else "r1", events)
        n += 8
        del events
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(
        stat.size_diff
        for stat in after.compare_to(before, "filename")
        if "kv_events" in str(stat) or "blocks.py" in str(stat)
    )
    assert index.blocks() == n
    assert 0 < grown <= n * index.entry_bytes()
    assert index.entry_bytes() == ENTRY_BYTES + (LRU_BYTES if track_lru else 0)


def test_leading_finds_each_replicas_first_miss_between_probes() -> None:
    index = _index()
    tokens = list(range(20 * BS))
    hashes = hashes_for(20)
    index.apply("r0", _events(stored(hashes, tokens, BS)))
    index.apply("r1", _events(stored(hashes_for(20, 5000), tokens, BS)))
    index.apply("r1", _events(*(removed([h]) for h in reversed(hashes_for(20, 5000)[11:]))))  # tail first
    keys = _keys(tokens)
    assert index.leading(keys) == {"r0": 20, "r1": 11}
    assert index.leading(keys, mask=index.mask_of(["r1"])) == {"r1": 11}
    assert index.leading(keys[:9]) == {"r0": 9, "r1": 9}


# -- an engine at a multiple of the route's block size, keyed at the route's -------------------
BIG = 4 * BS  # the engine's blocks: four of the route's


def test_an_engine_at_a_multiple_of_the_routes_size_is_keyed_at_the_routes() -> None:
    index = _index()
    index.key_at("r0", "chat", BS)
    tokens = list(range(3 * BIG))
    hashes = hashes_for(3)
    index.apply("r0", _events(stored(hashes[:2], tokens[: 2 * BIG], BIG)))
    index.apply("r0", _events(stored(hashes[2:], tokens[2 * BIG :], BIG, parent=hashes[1])))  # chains on
    assert index.keyed_size("r0") == BS and index.keys_per_block("r0") == 4
    keys = _keys([*tokens, 1, 2])
    assert index.leading(keys) == {"r0": 12}  # every route key of the three engine blocks
    assert index.leading(_keys(tokens[: 2 * BIG + BS])) == {"r0": 9}  # a prompt ending inside a block
    assert index.blocks("r0") == 3 and index.memory_bytes() == 12 * ENTRY_BYTES + 2 * 2048  # each key counts
    # a block stored again is a copy; removed once it is still held, twice it goes with all its keys
    index.apply("r0", _events(stored(hashes[2:], tokens[2 * BIG :], BIG, parent=hashes[1])))
    index.apply("r0", _events(removed(hashes[2:])))
    assert index.leading(keys) == {"r0": 12}
    index.apply("r0", _events(removed(hashes[2:])))
    assert index.leading(keys) == {"r0": 8}
    assert index.memory_bytes() == 8 * ENTRY_BYTES + 2 * 2048
    index.apply("r0", _events(cleared()))
    assert index.leading(keys) == {} and index.memory_bytes() == 2 * 2048


def test_the_key_size_is_the_smallest_asked_that_divides_the_engines_and_a_change_drops_the_entries() -> None:
    index = _index()
    tokens = list(range(2 * BIG))
    index.apply("r0", _events(stored(hashes_for(2), tokens, BIG)))
    assert index.keyed_size("r0") == BIG and index.blocks("r0") == 2  # no route asked: the engine's own
    generation = index.keying
    index.key_at("r0", "chat", 2 * BS)
    # no event names the tokens again: keyed at the old size, the entries go, relearned from here on
    assert index.keyed_size("r0") == 2 * BS and index.blocks("r0") == 0 and index.keying > generation
    index.key_at("r0", "batch", BS)  # two routes: the finer serves one of them
    index.key_at("r0", "odd", 3 * BS)  # not a divisor of 64: never chosen
    assert index.keyed_size("r0") == BS
    index.apply("r0", _events(stored(hashes_for(2, 70), tokens, BIG)))
    assert index.leading(_keys(tokens)) == {"r0": 8}
    index.keep_routes({"chat", "odd"})  # a reload without "batch"
    assert index.keyed_size("r0") == 2 * BS
    index.key_at("r0", "chat", None)
    assert index.keyed_size("r0") == BIG
    index.key_at("r1", "chat", 3 * BS)  # before any event: decided by the first block size seen
    assert index.keyed_size("r1") is None
    index.apply("r1", _events(stored(hashes_for(1, 90), list(range(BIG)), BIG)))
    assert index.keyed_size("r1") == BIG


def test_keyed_finer_the_window_the_bound_past_it_and_the_clock_count_in_route_keys() -> None:
    index = _index(max_depth_tokens=2 * BIG)
    index.track_lru = True
    index.key_at("r0", "chat", BS)
    tokens = list(range(5 * BIG))
    hashes = hashes_for(5)
    index.apply("r0", _events(stored(hashes, tokens, BIG)))
    keys = _keys(tokens)
    assert index.leading(keys) == {"r0": 8}  # the window: two engine blocks, eight route keys
    assert index.reach_past("r0", keys[7]) == 12  # three engine blocks past it, in route keys
    index.apply("r0", _events(removed(hashes[4:])))
    assert index.reach_past("r0", keys[7]) == 8
    # the clock counts route keys (the routes' allocations and capacities are in them): the
    # window was stamped at 20, one more engine block makes it 24, so a cache of 40 keys holds
    # the window until 36 more are allocated
    index.apply("r0", _events(stored(hashes_for(1, 80), [5] * BIG, BIG)))
    assert index.surviving("r0", keys, 8, 36, 40) == 8
    assert index.surviving("r0", keys, 8, 37, 40) == 0


def test_keyed_finer_memory_stays_under_the_byte_bound() -> None:
    bound = 200 * ENTRY_BYTES + 2 * 2048
    index = _index(max_bytes=bound)
    index.key_at("r0", "chat", BS)
    for i in range(30):
        tokens = [i] * (2 * BIG)
        index.apply("r0", _events(stored(hashes_for(2, 10_000 + 10 * i), tokens, BIG)))
        assert index.memory_bytes() <= bound
    assert index.evicted > 0
    assert index.leading(_keys([29] * (2 * BIG))) == {"r0": 8}  # its newest kept, every key of them
    assert index.leading(_keys([0] * (2 * BIG))) == {}


def test_a_malformed_event_at_another_size_neither_moves_the_key_size_nor_breaks_the_next_event() -> None:
    index = _index()
    tokens = list(range(4 * BIG))
    index.apply("r0", _events(stored(hashes_for(1), tokens[:BIG], BIG)))
    assert index.keyed_size("r0") == BIG
    bad = stored(hashes_for(1, 40), tokens[:10], 2 * BS)  # 10 tokens for a 32-token block
    index.apply("r0", _events(bad))
    assert index.skipped["bad_tokens"] == 1 and index.block_size("r0") == BIG  # its size is not believed
    # the engine really runs at 32 now (restarted): re-keyed at its size, no crash
    index.apply("r0", _events(stored(hashes_for(2, 50), tokens[: 4 * BS], 2 * BS)))
    assert index.keyed_size("r0") == 2 * BS
    assert index.leading(chain_block_keys(tokens[: 4 * BS], 2 * BS, engine_seed(MODEL, None, None))) == {"r0": 2}


def test_finer_keys_only_where_the_window_is_whole_engine_blocks_and_the_engines_own_size_wins() -> None:
    odd = _index(max_depth_tokens=3 * BIG + BS)  # a window ending inside an engine block
    odd.key_at("r0", "chat", BS)
    odd.apply("r0", _events(stored(hashes_for(1), list(range(BIG)), BIG)))
    assert odd.keyed_size("r0") == BIG  # keyed finer, it would never hold a request's whole window
    index = _index()
    index.key_at("r0", "fine", BS)
    index.key_at("r0", "own", BIG)  # a route hashing the engine's own size keeps its one-to-one keys
    index.apply("r0", _events(stored(hashes_for(1), list(range(BIG)), BIG)))
    assert index.keyed_size("r0") == BIG
    index.key_route("own", BIG, ["r1"])  # r0 left that route: only the finer one asks for it now
    assert index.keyed_size("r0") == BS
    index.forget("r0")  # gone from the gateway: no route's size is kept for it
    index.add("r0", MODEL)
    index.apply("r0", _events(stored(hashes_for(1, 60), list(range(BIG)), BIG)))
    assert index.keyed_size("r0") == BIG


def test_a_new_key_size_forgets_the_eviction_age_counted_in_the_old_keys() -> None:
    index = _index(max_bytes=1 << 24)
    index.track_lru = True
    for i in range(4):  # store and evict: an eviction age in 64-token keys
        index.apply("r0", _events(stored(hashes_for(1, 100 + i), [i] * BIG, BIG)))
        index.apply("r0", _events(removed(hashes_for(1, 100 + i))))
    assert index._replicas["r0"].evict_age is not None
    index.key_at("r0", "chat", BS)
    assert index.keyed_size("r0") == BS and index._replicas["r0"].evict_age is None
