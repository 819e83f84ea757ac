"""The prefix policy with precise replicas: matched from what their engines hold, speculative
choices, past-the-window extension, block-size mismatch and the stale fallback."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from gateway.kv_events.service import KvEvents
from gateway.kv_events.settings import KvEventsSettings
from gateway.prefix.blocks import chain_block_keys, engine_seed
from gateway.replicas.engine import EngineStats
from gateway.replicas.pool import Replica
from gateway.routing.base import ReplicaView, RequestView
from gateway.routing.policies.prefix import PrefixPolicy, PrefixPolicySettings
from gateway.service import Gateway
from tests.configs import gateway_config
from tests.kv_events.frames import cleared, hashes_for, removed, stored
from tests.kv_events.test_kv_index import _events

NAMES = ["r0", "r1", "r2", "r3"]
MODEL = "m"
BS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _setup(precise: list[str] = NAMES, **settings: Any) -> tuple[PrefixPolicy, KvEvents, Clock]:
    clock = Clock()
    events = KvEvents(KvEventsSettings(**settings), lambda: {}, clock=clock)
    for name in precise:
        events.index.add(name, MODEL)
        feed = events.ingestor.feed(name)
        feed.subscribed = True
        events.ingestor.ingest(name, 0, 0, [])  # heard: precise
    policy = PrefixPolicy(PrefixPolicySettings(), [ReplicaView(n) for n in NAMES])
    policy.attach_precise(events.routing)
    return policy, events, clock


def _tokens(seed: int, blocks: int) -> list[int]:
    return [seed * 10_000 + i for i in range(blocks * BS)]


def _request(tokens: list[int], extra_keys: tuple[int, ...] = (), rid: str = "x") -> RequestView:
    keys = tuple(chain_block_keys(tokens, BS, engine_seed(MODEL, None, None)))
    blocks = len(keys)
    return RequestView(
        rid,
        "route",
        MODEL,
        "chat",
        None,
        keys + extra_keys,
        BS,
        len(tokens) + 3,
        len(tokens) + 3 + 1000 * len(extra_keys),
        token_blocks=blocks if extra_keys else None,
        key_tokens=tuple(len(tokens) + 1000 * (i + 1) for i in range(len(extra_keys))),
    )


def _engine_holds(events: KvEvents, name: str, tokens: list[int], seq: int) -> None:
    events.ingestor.ingest(name, 0, seq, _events(stored(hashes_for(len(tokens) // BS, seq * 1000), tokens, BS)))


def _views() -> list[ReplicaView]:
    return [ReplicaView(n) for n in NAMES]


def test_routing_follows_what_the_engine_holds_not_what_the_model_remembers() -> None:
    policy, events, _clock = _setup(speculative_s=0)
    tokens = _tokens(1, 6)
    first = policy.choose(_request(tokens), _views())
    assert first.detail["kv_mode"] == "precise"
    # the model now remembers `first.replica`; the engine says another replica holds 4 blocks
    other = next(n for n in NAMES if n != first.replica)
    _engine_holds(events, other, tokens[: 4 * BS], 1)
    decision = policy.choose(_request(tokens), _views())
    assert decision.replica == other and decision.detail["predicted_cached_tokens"] == 4 * BS
    # the engine reset its cache: nothing is held anywhere, whatever the model remembers
    events.ingestor.ingest(other, 0, 2, _events(cleared()))
    assert policy.peek(_request(tokens), _views()).detail["predicted_cached_tokens"] == 0


def test_a_choice_counts_as_held_until_the_engine_speaks_then_only_for_speculative_s() -> None:
    policy, events, clock = _setup(speculative_s=10, stale_s=1000)
    tokens = _tokens(2, 8)
    first = policy.choose(_request(tokens, rid="a"), _views())
    burst = policy.choose(_request(tokens, rid="b"), _views())
    assert burst.replica == first.replica and burst.detail["predicted_cached_tokens"] == 8 * BS  # its deepest key
    clock.now += 11
    # past speculative_s both still wait in the engine's queue: what they will compute counts
    later = policy.peek(_request(tokens), _views())
    assert (later.replica, later.detail["predicted_cached_tokens"]) == (first.replica, 8 * BS)
    for rid in "ab":  # they ended, and the engine never said it stored anything
        events.routing.finished(first.replica, _request(tokens, rid=rid))
    assert policy.peek(_request(tokens), _views()).detail["predicted_cached_tokens"] == 0
    # a failed attempt is withdrawn at once
    clock.now += 100
    again = policy.choose(_request(tokens, rid="c"), _views())
    policy.forget_attempt(_request(tokens, rid="c"), again)
    assert policy.peek(_request(tokens), _views()).detail["predicted_cached_tokens"] == 0


def test_past_the_window_the_engines_whole_window_extends_with_the_models_text_keys() -> None:
    policy, events, _clock = _setup(speculative_s=0)
    tokens = _tokens(3, 4)
    text = (111, 222, 333)
    first = policy.choose(_request(tokens, text), _views())  # the model records the text keys there
    assert first.detail["predicted_cached_tokens"] == 0
    _engine_holds(events, first.replica, tokens, 1)  # the engine holds the whole window
    deep = policy.peek(_request(tokens, text), _views())
    assert deep.replica == first.replica and deep.detail["matched_blocks"] == 4 + 3
    events.ingestor.ingest(first.replica, 0, 2, _events(cleared()))
    assert policy.peek(_request(tokens, text), _views()).detail["matched_blocks"] == 0


def test_a_turn_over_the_context_takes_no_text_key_back_from_the_conversation_before_it() -> None:
    """The conversation grew past its model's max_model_len: the engine refuses the turn (400),
    and the gateway, which recorded nothing for it, withdraws nothing either (a withdrawal takes
    every text key of the request off the replica: the conversation's own history with it)."""
    policy, events, _clock = _setup(speculative_s=0)
    tokens = _tokens(5, 4)
    text = (111, 222, 333)
    first = policy.choose(_request(tokens, text, rid="a"), _views())
    _engine_holds(events, first.replica, tokens, 1)
    over = replace(_request(tokens, (*text, 444, 555), rid="b"), context_limit=4 * BS + 4000)
    decision = policy.choose(over, _views())
    assert decision.replica == first.replica and decision.detail["over_context"] is True
    policy.forget_attempt(over, decision)  # the engine's 400
    assert events.routing.text_tail.extend(first.replica, over.block_keys, 4, 5) == 4 + 3
    shorter = policy.peek(_request(tokens, (*text, 666), rid="c"), _views())
    assert shorter.replica == first.replica and shorter.detail["matched_blocks"] == 4 + 3


def test_past_the_window_the_prediction_is_bounded_by_what_the_engine_still_holds_there() -> None:
    # the index keys the 4-block window; the engine's events go on past it (3 text keys there,
    # ~1,000 tokens each in the request; 200 blocks of the engine's)
    policy, events, _clock = _setup(speculative_s=0, max_depth_tokens=4 * BS)
    tokens = _tokens(3, 4)
    text = (111, 222, 333)
    request = _request(tokens, text, rid="a")
    first = policy.choose(request, _views())  # the model records the text keys there
    name = first.replica
    whole = tokens + _tokens(4, 200)
    hashes = hashes_for(204, 7000)
    events.ingestor.ingest(name, 0, 1, _events(stored(hashes, whole, BS)))
    policy.observe(request, first, 0)  # it ended: nothing in flight there pins the window
    held = policy.peek(_request(tokens, text, rid="b"), _views())
    assert held.replica == name and held.detail["predicted_cached_tokens"] == (3 * 1000 + 4 * BS + 2) // BS * BS
    # the engine evicts the prompt's tail: 60 of its 200 blocks past the window stay
    events.ingestor.ingest(name, 0, 2, _events(removed(hashes[64:])))
    tail = policy.peek(_request(tokens, text, rid="c"), _views())
    assert tail.detail["matched_blocks"] == 4 + 3  # ranked by the records, as before ...
    assert tail.detail["predicted_cached_tokens"] == 64 * BS  # ... predicted as the engine holds
    # a request in flight there with the same window computes past it before this one runs
    policy.choose(_request(tokens, text, rid="d"), [ReplicaView(name)])
    assert policy.peek(_request(tokens, text, rid="e"), _views()).detail["predicted_cached_tokens"] > 64 * BS


def test_a_burst_behind_a_queued_document_is_predicted_to_the_block_where_its_prompts_part() -> None:
    # a batch: one document (13 blocks: not a multiple of the speculative stride, 8), then each
    # request's own question; the first is still queued (no events yet) when the others come
    policy, _, _clock = _setup(speculative_s=10, stale_s=1000)
    doc = _tokens(8, 13)
    first = policy.choose(_request(doc + _tokens(9, 3), rid="a"), _views())
    other = _request(doc + _tokens(10, 3), rid="b")
    decision = policy.peek(other, [ReplicaView(first.replica)])
    assert decision.detail["kv_mode"] == "precise"
    assert decision.detail["predicted_cached_tokens"] == 13 * BS  # at the stride alone: 8 blocks


def test_an_approximate_replica_past_the_window_is_matched_at_the_text_tails_resolution() -> None:
    # no replica heard yet (a burst before any events): the model keeps every 4th key, so past
    # the window its match stops short of text keys the gateway sent there; the text tail has them
    for precise in ([], ["r0"]):  # every replica approximate; or some precise, the others not
        policy, _, _clock = _setup(precise=precise, speculative_s=0)
        views = [ReplicaView(n) for n in NAMES if n not in precise]
        tokens = _tokens(11, 4)
        first = policy.choose(_request(tokens, (111, 222, 333, 444, 555), rid="a"), views)
        assert first.detail["kv_mode"] == "approximate"
        other = policy.peek(_request(tokens, (111, 222, 333, 999), rid="b"), views)
        assert other.replica == first.replica
        assert other.detail["matched_blocks"] == 4 + 3  # the model alone: 4 (its stride key), its tokens 64
        assert other.detail["predicted_cached_tokens"] == len(tokens) + 3000 - (len(tokens) + 3000) % BS


def test_approximate_replicas_keep_the_model_and_modes_show_in_the_decision() -> None:
    policy, events, clock = _setup(precise=["r0", "r1"], speculative_s=0, stale_s=5)
    tokens = _tokens(4, 4)
    views = [ReplicaView("r2"), ReplicaView("r3")]  # only the approximate ones eligible
    first = policy.choose(_request(tokens), views)
    assert first.detail["kv_mode"] == "approximate"
    again = policy.choose(_request(tokens), views)
    assert again.replica == first.replica and again.detail["predicted_cached_tokens"] == 4 * BS
    # r0 is precise, then goes stale after a request storing blocks got no events
    _engine_holds(events, "r0", tokens, 1)
    assert policy.peek(_request(tokens), [ReplicaView("r0")]).detail["kv_mode"] == "precise"
    policy.choose(_request(_tokens(5, 4)), [ReplicaView("r0")])
    clock.now += 6
    stale = policy.peek(_request(_tokens(6, 4)), [ReplicaView("r0")])
    assert stale.detail["kv_mode"] == "approximate"
    assert events.mode_of("r0") == ("approximate", "stale")


def test_a_route_hashing_another_block_size_is_not_matched_precisely() -> None:
    _policy, events, _clock = _setup(speculative_s=0)
    events.ingestor.ingest("r0", 0, 1, _events(stored(hashes_for(1), list(range(128)), 128)))
    assert events.mode_of("r0", 16) == ("approximate", "block_size_mismatch")
    assert events.mode_of("r0", 128) == ("precise", None)
    assert events.routing.mode_of("r1", 16) == ("precise", None)  # no store seen: nothing to disagree with


def test_a_replica_at_a_multiple_of_the_routes_block_size_is_matched_from_its_events() -> None:
    policy, events, clock = _setup(speculative_s=10, stale_s=5)
    big = 4 * BS
    views = [ReplicaView("r0", block_size=big), ReplicaView("r1")]
    events.routing.key_route("route", BS, ["r0", "r1"])  # what Route.follow_engines tells it
    tokens = _tokens(8, 10)  # 160 tokens: two engine blocks of 64 and half of a third
    events.ingestor.ingest("r0", 0, 1, _events(stored(hashes_for(2, 800), tokens[: 2 * big], big)))
    assert events.mode_of("r0", BS) == ("precise", None)
    decision = policy.peek(_request(tokens), views)
    assert decision.replica == "r0" and decision.detail["kv_mode"] == "precise"
    assert decision.detail["predicted_cached_tokens"] == 2 * big
    # the engine evicts its second block: the prediction follows its word, not the model's
    events.ingestor.ingest("r0", 0, 2, _events(removed(hashes_for(2, 800)[1:])))
    assert policy.peek(_request(tokens), views).detail["predicted_cached_tokens"] == big
    # chosen there, the choice waits for the engine's last whole block (keys 5-8), not key 10,
    # which ends inside a block the engine never stores
    policy.choose(_request(tokens), views)
    assert len(events.routing.speculative) > 0
    again = stored(hashes_for(1, 900), tokens[big : 2 * big], big, parent=hashes_for(1, 800)[0])
    events.ingestor.ingest("r0", 0, 3, _events(again))
    assert len(events.routing.speculative) == 0
    # a prompt whose new part ends inside an engine block stores nothing: no events are owed
    clock.now += 1
    policy.choose(_request(tokens[: 2 * big + 2 * BS]), views)
    clock.now += 10
    assert events.mode_of("r0", BS) == ("precise", None)


def test_the_engines_word_ends_a_speculative_choice_so_its_evictions_count_at_once() -> None:
    policy, events, clock = _setup(speculative_s=10, stale_s=1000)
    tokens = _tokens(7, 4)
    first = policy.choose(_request(tokens), _views())
    hashes = hashes_for(4, 700)
    events.ingestor.ingest(first.replica, 0, 1, _events(stored(hashes, tokens, BS)))  # the engine confirms
    assert len(events.routing.speculative) == 0
    events.routing.finished(first.replica, _request(tokens))  # it ended, then its tail was evicted
    events.ingestor.ingest(first.replica, 0, 2, _events(*(removed([h]) for h in reversed(hashes[2:]))))
    clock.now += 1  # well within speculative_s: only the engine's word counts now
    assert policy.peek(_request(tokens), _views()).detail["predicted_cached_tokens"] == 2 * BS


def test_a_request_in_flight_is_credited_past_speculative_s_and_through_a_preemption() -> None:
    policy, events, clock = _setup(speculative_s=10, stale_s=1000)
    tokens = _tokens(8, 16)
    first = policy.choose(_request(tokens, rid="a"), _views())
    name = first.replica
    clock.now += 60  # still queued there a minute later: it computes the blocks before the next one runs
    later = policy.choose(_request(tokens, rid="b"), _views())
    assert (later.replica, later.detail["predicted_cached_tokens"]) == (name, 16 * BS)
    # it ran (stored), was preempted (its blocks freed, then evicted): it will compute them again first
    hashes = hashes_for(16, 800)
    events.ingestor.ingest(name, 0, 1, _events(stored(hashes, tokens, BS)))
    events.ingestor.ingest(name, 0, 2, _events(*(removed([h]) for h in reversed(hashes[4:]))))
    again = policy.peek(_request(tokens), _views())
    assert (again.replica, again.detail["predicted_cached_tokens"]) == (name, 16 * BS)
    # a request sharing the first 12 blocks: credited to the stride (8) below what it shares
    part = policy.peek(_request([*tokens[: 12 * BS], *_tokens(9, 4)]), _views())
    assert part.detail["predicted_cached_tokens"] == 8 * BS
    # both ended: only what the engine holds counts
    for rid in "ab":
        events.routing.finished(name, _request(tokens, rid=rid))
    assert policy.peek(_request(tokens), _views()).detail["predicted_cached_tokens"] == 4 * BS
    # with more prefill queued there than its whole cache, a request in flight saves nothing
    policy.index.set_token_capacity(name, 48 * BS)
    policy.choose(_request(tokens, rid="c"), _views())
    clock.now += 60
    busy = [ReplicaView(n, pending_prefill_tokens=60 * BS if n == name else 0) for n in NAMES]
    assert policy.peek(_request(tokens), busy).detail["predicted_cached_tokens"] == 4 * BS


def test_a_cleared_cache_ends_the_credit_of_the_requests_in_flight() -> None:
    policy, events, clock = _setup(speculative_s=10, stale_s=1000)
    tokens = _tokens(10, 8)
    name = policy.choose(_request(tokens, rid="a"), _views()).replica
    clock.now += 60
    assert policy.peek(_request(tokens), _views()).detail["predicted_cached_tokens"] == 8 * BS
    events.ingestor.ingest(name, 0, 1, _events(cleared()))  # a restart: what ran there is gone
    assert policy.peek(_request(tokens), _views()).detail["predicted_cached_tokens"] == 0


def _gateway(n: int, **overrides: Any) -> Gateway:
    """A gateway (built, not started) with one prefix route over ``n`` replicas nobody serves."""
    urls = [f"http://127.0.0.1:{9 + i}" for i in range(n)]
    return Gateway(gateway_config(urls, routes=[{"name": "main", "policy": "prefix"}], **overrides))


def _gateway_over(names: list[str]) -> tuple[Gateway, Clock]:
    """:func:`_gateway` with its KV-event subsystem fed by hand on a test clock, each replica precise."""
    gw = _gateway(len(names))
    clock = Clock()
    gw.kv_events.routing.clock = gw.kv_events.ingestor.clock = clock
    for name in names:
        gw.kv_events.index.add(name, MODEL)
        gw.kv_events.ingestor.feed(name).subscribed = True
        gw.kv_events.ingestor.ingest(name, 0, 0, [])
    return gw, clock


def test_an_engine_that_lost_its_cache_is_not_credited_with_it_when_it_falls_back_to_the_model() -> None:
    gw, clock = _gateway_over(["r0", "r1"])
    policy = gw.routes.routes[0].runner.policy
    assert isinstance(policy, PrefixPolicy)
    tokens = _tokens(7, 6)
    views = [ReplicaView("r0")]
    policy.choose(_request(tokens), views)  # the model records the choice; the engine stores it
    _engine_holds(gw.kv_events, "r0", tokens, 1)
    assert policy.peek(_request(tokens), views).detail["predicted_cached_tokens"] == 6 * BS

    # a gap nobody could replay: the index lost track, the engine did not — the model's belief stays
    gw.kv_events.ingestor.resync("r0", 0, 5, [])
    gw.kv_events.ingestor.feed("r0").resubscribed()  # ... and its feed falls back to the model
    clock.now += 1  # the modes are looked at again
    fallback = policy.peek(_request(tokens), views)
    assert fallback.detail["kv_mode"] == "approximate" and fallback.detail["predicted_cached_tokens"] == 6 * BS

    # the engine's cache reset (AllBlocksCleared): once its feed falls back, the model has forgotten too
    gw.kv_events.ingestor.ingest("r0", 0, 0, [])
    gw.kv_events.ingestor.ingest("r0", 0, 1, _events(cleared()))
    assert policy.peek(_request(tokens), views).detail["predicted_cached_tokens"] == 0
    gw.kv_events.ingestor.feed("r0").resubscribed()
    clock.now += 1
    after = policy.peek(_request(tokens), views)
    assert after.detail["kv_mode"] == "approximate" and after.detail["predicted_cached_tokens"] == 0
    assert policy.index.knows("r0")  # still a member, relearning from the next choice


def test_a_restart_seen_in_the_engines_counters_clears_the_model_without_events() -> None:
    gw = _gateway(2, kv_events={"enabled": False})
    policy = gw.routes.routes[0].runner.policy
    assert isinstance(policy, PrefixPolicy)
    tokens = _tokens(8, 6)
    views = [ReplicaView("r1")]
    policy.choose(_request(tokens), views)
    assert policy.peek(_request(tokens), views).detail["predicted_cached_tokens"] == 6 * BS
    replica = gw.replicas["r1"]
    replica.set_engine(EngineStats(0.0, prefix_cache_queries=500, prompt_tokens=500, generation_tokens=50))
    replica.set_engine(EngineStats(0.0, prefix_cache_queries=20, prompt_tokens=20, generation_tokens=2))  # it restarted
    assert replica.restarts_detected["counters_reset"] == 1
    assert policy.peek(_request(tokens), views).detail["predicted_cached_tokens"] == 0


def test_a_new_conversation_matched_to_a_shared_heads_exact_end_is_a_start_not_its_holders_history() -> None:
    """The engine's word ends where prompts first differ: behind a shared head that is the
    head's exact end, which the model stores no key for (only every stride-th block).  It must
    still be judged a shared head (a new conversation behind it), not the holder's own history."""
    policy, events, _clock = _setup(speculative_s=0)
    head = _tokens(5, 13)  # 13 blocks: no stride key (every 4th) at its end
    holder = None
    for seq, tail in enumerate((6, 7), start=1):
        tokens = head + _tokens(tail, 6)
        decision = policy.choose(_request(tokens, rid=f"c{tail}"), _views())
        holder = holder or decision.replica
        _engine_holds(events, holder, tokens, seq)
    newcomer = _request(head + _tokens(8, 5), rid="new")
    explained = policy.peek(newcomer, _views())
    assert explained.detail["best_matched_blocks"] == 13  # the engine holds the head, exactly
    assert explained.detail["branch"] != "home"
    starts = policy.demand.recent_starts()
    policy.choose(newcomer, _views())
    assert policy.demand.recent_starts() > starts  # counted behind the head


def test_a_preamble_every_prompt_shares_is_predicted_but_not_routed_on() -> None:
    """Engines report the chat template's first blocks for nearly every prompt; the model, at
    its stride, never sees them.  Routed on, they pulled new conversations to busy replicas
    and counted each as a start behind a shared head."""
    policy, events, _clock = _setup(speculative_s=0)
    preamble = _tokens(9, 2)  # 2 blocks: below the stride (4)
    for seq, name in enumerate(NAMES, start=1):
        _engine_holds(events, name, preamble, seq)
    request = _request(preamble + _tokens(10, 6), rid="new")
    explained = policy.peek(request, _views())
    assert explained.detail["branch"] == "ring" and explained.detail["matched_blocks"] == 0
    assert explained.detail["predicted_cached_tokens"] == 2 * BS  # still what the engine will hit
    starts = policy.demand.recent_starts()
    assert policy.choose(request, _views()).detail["predicted_cached_tokens"] == 2 * BS
    assert policy.demand.recent_starts() == starts  # no start behind a "head" of 32 tokens
    # a request that is only the short prefix is matched by it (the whole request)
    assert policy.peek(_request(preamble, rid="short"), _views()).detail["matched_blocks"] == 2


def test_a_replica_is_precise_as_soon_as_its_first_events_arrive() -> None:
    """The live set is cached for 0.1 s; a feed heard for the first time (or resubscribed)
    is looked at again at once, so the request right after its first events is matched
    precisely (and gets the text prints only precise matching reads)."""
    _policy, events, clock = _setup(precise=["r0"])
    assert events.routing.live() == frozenset({"r0"})
    feed = events.ingestor.feed("r1")
    feed.subscribed = True
    clock.now += 0.01  # well within the live set's 0.1 s
    events.ingestor.ingest("r1", 0, 0, [])
    assert events.routing.live() == frozenset({"r0", "r1"})


def test_the_routes_block_size_reaches_the_index_before_any_request() -> None:
    """A replica at a multiple of its route's block size: the route's size is told to the index
    as soon as the KV-event subsystem reconciles (before it subscribes), so its first events
    are keyed at the route's size, not at the engine's and dropped at the first request."""
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    gw = Gateway(gateway_config(urls, routes=[{"name": "main", "policy": "prefix", "prefix": {"block_size": BS}}]))
    route = gw.routes.routes[0]  # hashing 16 (set by hand), under engines at 64
    for replica in route.runner.replicas:
        replica.block_size = 4 * BS
    Replica.block_size_epoch += 1
    calls: list[str] = []

    async def subscribe(replica: Any) -> None:
        calls.append(replica.name)

    async def reconcile_once() -> None:
        gw.kv_events._subscribe = subscribe  # type: ignore[method-assign]
        gw.kv_events.reconcile()
        await asyncio.gather(*gw.kv_events._subs.values())

    asyncio.run(reconcile_once())
    assert sorted(calls) == ["r0", "r1"]
    index = gw.kv_events.index
    index.add("r0", MODEL)
    tokens = _tokens(9, 8)
    index.apply("r0", _events(stored(hashes_for(2, 990), tokens, 4 * BS)))
    assert index.keyed_size("r0") == BS and index.leading(_request(tokens).block_keys) == {"r0": 8}


def test_a_route_whose_keys_its_replica_is_not_indexed_at_owes_no_events_and_leaves_the_other_precise() -> None:
    """Two routes over one replica: one hashes the engine's size (its keys are the index's), the
    other a finer size (routed by the model there). The finer route's choices never find their
    keys in the index; counted as blocks the engine should report, they would turn the replica
    stale for both routes."""
    policy, events, clock = _setup(speculative_s=10, stale_s=5)
    big = 4 * BS
    events.routing.key_route("own", big, ["r0"])
    events.routing.key_route("route", BS, ["r0"])  # _request's route: 16-token keys
    events.ingestor.ingest("r0", 0, 1, _events(stored(hashes_for(1, 700), _tokens(3, 4), big)))
    assert events.mode_of("r0", big) == ("precise", None)
    assert events.mode_of("r0", BS) == ("approximate", "block_size_mismatch")
    views = [ReplicaView("r0", block_size=big)]
    for i in range(3):
        policy.choose(_request(_tokens(20 + i, 8)), views)
    clock.now += 10
    assert events.mode_of("r0", big) == ("precise", None)


def test_the_default_guess_is_not_sent_to_the_index_before_the_engines_are_scraped() -> None:
    urls = ["http://127.0.0.1:9"]
    gw = Gateway(gateway_config(urls, routes=[{"name": "main", "policy": "prefix"}]))  # block_size: auto
    gw.kv_events.follow_routes()  # no scrape yet: the route guesses 16
    assert gw.routes.routes[0].pipeline.block.source == "default"
    index = gw.kv_events.index
    index.add("r0", MODEL)
    index.apply("r0", _events(stored(hashes_for(1, 980), _tokens(9, 8), 8 * BS)))
    assert index.keyed_size("r0") == 8 * BS  # the engine's own: kept when the scrape says 128
    gw.routes.routes[0].runner.replicas[0].block_size = 8 * BS
    Replica.block_size_epoch += 1
    gw.kv_events.follow_routes()
    assert index.keyed_size("r0") == 8 * BS and index.blocks("r0") == 1


def test_a_route_renamed_by_a_reload_re_keys_nothing() -> None:
    """The new routes tell their sizes before the old routes' are dropped: a replica keyed finer
    for a route that is only renamed keeps its entries."""
    urls = ["http://127.0.0.1:9"]
    routes = [{"name": "main", "policy": "prefix", "prefix": {"block_size": BS}}]
    gw = Gateway(gateway_config(urls, routes=routes))
    replica = gw.routes.routes[0].runner.replicas[0]
    replica.block_size = 4 * BS
    Replica.block_size_epoch += 1
    gw.kv_events.follow_routes()
    index = gw.kv_events.index
    index.add("r0", MODEL)
    index.apply("r0", _events(stored(hashes_for(2, 990), _tokens(9, 8), 4 * BS)))
    assert index.keyed_size("r0") == BS and index.blocks("r0") == 2
    renamed = Gateway(gateway_config(urls, routes=[{**routes[0], "name": "chat"}])).routes.routes
    renamed[0].runner.replicas[0].block_size = 4 * BS
    gw.kv_events.attach(renamed)  # what a reload does with its new routes
    assert index.keyed_size("r0") == BS and index.blocks("r0") == 2
    assert index._wants["r0"] == {"chat": BS}
