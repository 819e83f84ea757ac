"""The engine's state projected forward (``kv_events.project_evictions``): the index's LRU
clock and eviction age, the gateway's touches, requests in flight pinning their blocks, and
the policy predicting what survives the queued work while it still ranks by the engine's word."""

from __future__ import annotations

from gateway.kv_events import routing
from gateway.kv_events.index import PreciseIndex
from gateway.kv_events.routing import Pinned
from gateway.kv_events.service import KvEvents
from gateway.routing.base import ReplicaView
from gateway.routing.policies.prefix import PrefixPolicy
from tests.kv_events.frames import hashes_for, removed, stored
from tests.kv_events.test_kv_index import BS, MODEL, _events, _keys
from tests.kv_events.test_kv_policy import NAMES, _engine_holds, _request, _setup, _tokens


def _stored_index(chains: int, blocks: int) -> tuple[PreciseIndex, list[list[int]], list[list[int]]]:
    """``r0`` stores ``chains`` prompts of ``blocks`` blocks one after the other (oldest first)."""
    index = PreciseIndex(1 << 24)
    index.track_lru = True  # as PreciseRouting sets it with kv_events.project_evictions
    index.add("r0", MODEL)
    keys, hashes = [], []
    for c in range(chains):
        tokens = [c * 100_000 + i for i in range(blocks * BS)]
        chain = hashes_for(blocks, 1000 * (c + 1))
        index.apply("r0", _events(stored(chain, tokens, BS)))
        keys.append(_keys(tokens))
        hashes.append(chain)
    return index, keys, hashes


def test_queued_allocations_evict_the_oldest_chains_first_and_a_touch_keeps_one() -> None:
    index, keys, _ = _stored_index(4, 8)  # clock 32: chain 0 stored at 8, chain 3 at 32
    assert index.surviving("r0", keys[0], 8, 0, 32) == 8  # nothing queued: the engine's word
    assert index.surviving("r0", keys[0], 8, 100, 1000) == 8  # room for the queued work
    # 8 more blocks with a 32-block cache: the front passes chain 0's stamp (8), not chain 1's (16)
    assert index.surviving("r0", keys[0], 8, 9, 32) == 0
    assert index.surviving("r0", keys[1], 8, 9, 32) == 8
    index.touch("r0", keys[0][:5])  # a request used chain 0's first 5 blocks just now
    assert index.surviving("r0", keys[0], 8, 9, 32) == 5  # its head survives, its tail does not


def test_a_touch_promised_after_queued_work_is_not_moved_back_and_stops_at_the_first_miss() -> None:
    index, keys, _ = _stored_index(2, 4)  # clock 8
    index.touch("r0", keys[0], ahead_blocks=100)  # used once the 100 queued blocks are allocated
    index.touch("r0", keys[0])  # an earlier touch (a request finishing now) does not age it
    assert index.surviving("r0", keys[0], 4, 150, 100) == 4  # front 8 + 150 - 100 = 58 < 108
    other = [*keys[1][:2], 12345, *keys[1][3:]]
    index.touch("r0", other, ahead_blocks=1000)  # blocks past a miss are not what the request hits
    assert index.surviving("r0", keys[1], 4, 101, 100) == 2  # front 9 passes the stamp 8 of the rest


def test_the_age_at_which_the_engine_evicts_replaces_the_cache_size() -> None:
    index, keys, hashes = _stored_index(4, 8)  # clock 32
    # the engine evicts chain 0 (stored 24 blocks ago): its free queue is 24 blocks long, not 1000
    index.apply("r0", _events(removed(hashes[0])))
    assert index.leading(keys[0]) == {}
    assert index.surviving("r0", keys[1], 8, 7, 1000) == 8  # age 16 + 7 < 24
    assert index.surviving("r0", keys[1], 8, 9, 1000) == 0  # age 16 + 9 > 24


def test_pinned_keys_last_from_the_choice_to_the_end_or_their_ttl() -> None:
    now = [0.0]
    pinned = Pinned(60.0, lambda: now[0])
    keys = list(range(1, 21))
    pinned.pin("r0", keys[:12])
    assert pinned.depth("r0", keys, 0, 20) == 12  # its deepest key
    assert pinned.depth("r0", keys, 0, 10) == 8  # every 8th key below it
    assert pinned.depth("r1", keys, 3, 20) == 3  # nothing in flight there
    pinned.pin("r0", keys[:12])  # a twin request
    pinned.unpin("r0", keys[:12])
    assert pinned.depth("r0", keys, 0, 20) == 12  # the twin still runs
    pinned.unpin("r0", keys[:12])
    assert pinned.depth("r0", keys, 0, 20) == 0
    pinned.pin("r0", keys[:4])
    now[0] = 61.0
    pinned.pin("r1", keys[:4])  # any call purges what expired
    assert pinned.depth("r0", keys, 0, 20) == 0
    assert pinned.depth("r1", keys, 0, 20) == 4


def test_ended_requests_do_not_stay_in_the_expiry_queue_for_their_ttl() -> None:
    """Every request pins on its choice and unpins at its end; the expiry queue must not keep
    the ended ones for ttl_s (600 s in the gateway: ~220 bytes a request, 160 MB at 1,200/s)."""
    now = [0.0]
    pinned = Pinned(600.0, lambda: now[0])
    for i in range(20_000):
        keys = [i * 100 + k for k in range(1, 20)]
        pinned.pin(f"r{i % 4}", keys)
        pinned.unpin(f"r{i % 4}", keys)
        now[0] += 0.001
    assert len(pinned._queue) <= 2 * routing._COMPACT_MIN  # not 20,000
    live = [[10**9 + k for k in range(1, 20)], [2 * 10**9 + k for k in range(1, 20)]]
    for keys in live:  # requests still running survive the compactions
        pinned.pin("r0", keys)
    for i in range(5_000):
        keys = [i * 100 + k for k in range(1, 20)]
        pinned.pin("r1", keys)
        pinned.unpin("r1", keys)
    assert all(pinned.depth("r0", keys, 0, 19) == 19 for keys in live)
    pinned.forget("r0")  # what a reset empties is compacted the same way
    now[0] += 601.0
    pinned.pin("r2", [7, 8])  # ... and the expiry still purges the rest
    assert len(pinned._queue) == 1 and pinned._ended == 0


def test_what_a_request_in_flight_shares_is_found_by_bisection_over_its_strided_keys() -> None:
    pinned = Pinned(60.0, lambda: 0.0)
    keys = list(range(1, 41))
    pinned.pin("r0", keys[:27])  # every 8th key (8, 16, 24) and its deepest (27)
    assert pinned.shared("r0", keys, 0, 27) == 27  # shares all of them: exact
    assert pinned.shared("r0", keys, 0, 40) == 24  # shares 27 of 40: to the stride below
    assert pinned.shared("r0", keys, 0, 20) == 16
    assert pinned.shared("r0", keys, 20, 40) == 24
    assert pinned.shared("r0", keys, 30, 40) == 30  # never below what is asked from
    other = [*keys[:10], *range(100, 130)]  # parts from it after 10 keys
    assert pinned.shared("r0", other, 0, 40) == 8
    assert pinned.shared("r1", keys, 0, 40) == 0  # nothing in flight there
    pinned.pin("r1", keys[:5])  # shorter than the stride: its deepest key is its first kept one
    assert pinned.sharing({"r0", "r1", "r2"}, keys, 40) == ["r0"]  # looked up by the first strided key
    assert pinned.sharing({"r0", "r1"}, keys, 5) == ["r1"]
    assert pinned.sharing({"r1"}, keys, 40) == []
    pinned.unpin("r1", keys[:5])
    assert pinned.sharing({"r1"}, keys, 5) == []
    pinned.forget("r0")  # its engine lost its cache
    assert pinned.shared("r0", keys, 0, 40) == 0
    pinned.unpin("r0", keys[:27])  # the end heard later changes nothing
    assert pinned.depth("r0", keys, 0, 40) == 0
    assert pinned.sharing({"r0"}, keys, 40) == []


def _policy(project: bool) -> tuple[PrefixPolicy, KvEvents]:
    policy, events, _clock = _setup(speculative_s=0, project_evictions=project)
    for name in NAMES:  # what a scrape of vllm:cache_config_info tells the model: 48 blocks
        policy.index.set_token_capacity(name, 48 * BS)
    return policy, events


def _views(pending: dict[str, int], capacity: int) -> list[ReplicaView]:
    return [ReplicaView(n, pending_prefill_tokens=pending.get(n, 0), kv_cache_tokens=capacity) for n in NAMES]


def test_the_policy_predicts_what_survives_the_queued_work_but_ranks_by_the_engines_word() -> None:
    tokens = _tokens(1, 6)
    for project in (False, True):
        policy, events = _policy(project)
        # r2's engine stored the prompt; the model never recorded it there (it thinks r2 holds nothing)
        _engine_holds(events, "r2", tokens, 1)
        filler = _tokens(2, 40)  # then 40 more blocks: the prompt is 40 blocks old
        _engine_holds(events, "r2", filler, 2)
        # r2 has 20 blocks of prefill queued and a 48-block cache: the prompt will be evicted first
        decision = policy.choose(_request(tokens), _views({"r2": 20 * BS}, 48 * BS))
        assert decision.replica == "r2"  # the engine holds it now: still the best bet
        predicted = decision.detail["predicted_cached_tokens"]
        assert predicted == (0 if project else 6 * BS)
        # with nothing queued, the engine's word is the prediction either way
        policy, events = _policy(project)
        _engine_holds(events, "r2", tokens, 1)
        _engine_holds(events, "r2", filler, 2)
        decision = policy.choose(_request(tokens), _views({}, 48 * BS))
        assert (decision.replica, decision.detail["predicted_cached_tokens"]) == ("r2", 6 * BS)


def test_a_request_in_flight_pins_the_prefix_and_the_model_vetoes_a_discount() -> None:
    tokens = _tokens(1, 6)
    request = _request(tokens)
    policy, events = _policy(True)
    first = policy.choose(_request(tokens, rid="a"), _views({}, 48 * BS))  # recorded and pinned there
    name = first.replica
    _engine_holds(events, name, tokens, 1)
    _engine_holds(events, name, _tokens(2, 40), 2)
    # the model recorded the prompt there (its 48-block cache holds it): no discount
    decision = policy.choose(_request(tokens, rid="b"), _views({name: 20 * BS}, 48 * BS))
    assert (decision.replica, decision.detail["predicted_cached_tokens"]) == (name, 6 * BS)
    # the model evicts it (its LRU guessed wrong): the requests still in flight pin it
    policy.index.withdraw(name, list(request.block_keys))
    assert not policy.index.match(request.block_keys, [name])
    decision = policy.choose(_request(tokens, rid="c"), _views({name: 20 * BS}, 48 * BS))
    assert (decision.replica, decision.detail["predicted_cached_tokens"]) == (name, 6 * BS)
    # they end: the engine freed the blocks just now (the youngest in its queue), nothing pins them
    for _ in range(3):
        events.routing.finished(name, request)
    policy.index.withdraw(name, list(request.block_keys))
    assert not events.routing.pinned.depth(name, request.block_keys, 0, 6)
    decision = policy.choose(_request(tokens, rid="d"), _views({name: 20 * BS}, 48 * BS))
    assert decision.detail["predicted_cached_tokens"] == 6 * BS
    events.routing.finished(name, request)
    policy.index.withdraw(name, list(request.block_keys))
    _engine_holds(events, name, _tokens(3, 60), 3)  # 60 blocks later, 20 more queued: gone first
    decision = policy.choose(_request(tokens, rid="e"), _views({name: 20 * BS}, 48 * BS))
    assert (decision.replica, decision.detail["predicted_cached_tokens"]) == (name, 0)


def test_a_pin_does_not_outlast_a_queue_longer_than_the_whole_cache() -> None:
    """The request pinning a prefix finishes long before one queued behind more prefill than
    the cache holds runs, and that queue cycles the cache after it: no pin saves the prefix."""
    tokens = _tokens(1, 6)
    request = _request(tokens)
    policy, events = _policy(True)
    name = policy.choose(_request(tokens, rid="a"), _views({}, 48 * BS)).replica  # pinned there
    _engine_holds(events, name, tokens, 1)
    _engine_holds(events, name, _tokens(2, 40), 2)
    policy.index.withdraw(name, list(request.block_keys))  # the model agrees it goes
    # 40 blocks old: 20 queued ahead evict it, but the request in flight pins it
    short = policy.peek(_request(tokens, rid="b"), _views({name: 20 * BS}, 48 * BS))
    assert (short.replica, short.detail["predicted_cached_tokens"]) == (name, 6 * BS)
    # 60 queued ahead, more than the 48 the cache holds: the pinning request ends long before
    cycled = policy.peek(_request(tokens, rid="c"), _views({name: 60 * BS}, 48 * BS))
    assert (cycled.replica, cycled.detail["predicted_cached_tokens"]) == (name, 0)


def test_a_choice_still_waiting_there_outweighs_the_projected_discount() -> None:
    """The engine holds an old copy of the prompt's head that the queued work will evict, but a
    request chosen there with the whole prompt has not run yet: it computes those blocks again
    before the next one runs, so the projection's discount does not stand.  (Measured: the
    model's stride left a 1-block discount standing under a speculative match of the whole
    prompt, and a 38k-token hit was predicted as 2.4k.)"""
    tokens = _tokens(1, 10)
    policy, events, _clock = _setup(speculative_s=10, stale_s=1000, project_evictions=True)
    for name in NAMES:
        policy.index.set_token_capacity(name, 48 * BS)
    _engine_holds(events, "r2", tokens[: 7 * BS], 1)
    first = policy.choose(_request(tokens, rid="a"), _views({}, 48 * BS))
    assert first.replica == "r2" and len(events.routing.speculative) > 0  # waits for its blocks
    _engine_holds(events, "r2", _tokens(2, 40), 2)  # 40 blocks later: the head is old
    queued = _views({"r2": 20 * BS}, 48 * BS)  # 20 blocks queued: the old head goes first
    # the model (every 4th key) holds 4 of the engine's 7 blocks: alone, a discount to 4 would stand
    assert policy.index.match(_request(tokens).block_keys[:7], ["r2"]) == {"r2": 4}
    decision = policy.peek(_request(tokens, rid="b"), queued)
    assert (decision.replica, decision.detail["predicted_cached_tokens"]) == ("r2", 10 * BS)
    events.routing.withdraw("r2", _request(tokens, rid="a"))  # it failed: nothing computes the rest
    assert policy.peek(_request(tokens, rid="c"), queued).detail["predicted_cached_tokens"] == 4 * BS
