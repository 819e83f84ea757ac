"""How many holders a shared head gets: its share of new conversations (``gateway.routing.starts``)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

from gateway.config import HealthSettings, ReplicaConfig
from gateway.replicas.pool import Replica
from gateway.routing.base import ReplicaView
from gateway.routing.flows import RecentFlows
from gateway.routing.policies.prefix import PrefixPolicy
from gateway.routing.returns import StartReturns
from gateway.routing.runner import PolicyRunner
from gateway.routing.starts import HeadDemand
from gateway.routing.work import RecentWork
from tests.prefix.policy_helpers import NAMES, chain, policy, req, views


def test_a_head_needs_holders_in_proportion_to_its_share_of_starts() -> None:
    d = HeadDemand(window=10**9)  # no decay to speak of
    for head in (1, 2, 3):
        d.record(head)
    d.record(7)
    # head 7 with this start: 2 of 5 recent starts, over at least 8 (the prior) -> 2/8 = 0.25
    assert math.isclose(d.share(7, prior=8), 0.25)
    assert d.holders_needed(7, replicas=4, factor=1.0, prior=8) == 1  # 0.25 x 4 = 1
    for _ in range(8):
        d.record(7)
    # 10 of 13 recent starts: 10/13 x 4 = 3.08 -> 3 holders; 2.46 at factor 1.25 -> 2
    assert d.holders_needed(7, replicas=4, factor=1.0, prior=8) == 3
    assert d.holders_needed(7, replicas=4, factor=1.25, prior=8) == 2
    token = d.record(7)
    d.undo(token)
    assert math.isclose(d.recent_starts(), 12.0, rel_tol=1e-6)
    assert d.snapshot()["busiest_heads"][f"{7:016x}"] == round(9 / 12, 3)


def test_starts_decay_and_heads_are_bounded() -> None:
    d = HeadDemand(window=10, max_heads=3)
    for _ in range(100):
        d.record(1)
    for _ in range(100):
        d.record(2)  # head 1's starts are ~10 windows old: negligible
    # (a share counts the start being placed: +1 on both sides)
    assert d.share(1, prior=1) < 0.1 < 0.99 < d.share(2, prior=1)
    for head in (3, 4, 5):
        d.record(head)
    assert f"{1:016x}" not in d.snapshot(top=10)["busiest_heads"]  # evicted (LRU of 3 heads)
    for _ in range(5000):  # renormalises many times without drifting
        d.record(6)
    assert math.isclose(d.recent_starts(), 1 / (1 - math.exp(-1 / 10)), rel_tol=1e-6)


def test_new_conversations_behind_one_busy_head_spread_while_each_stays_home() -> None:
    """16 conversations behind one 10k-token head, all in flight: the head draws every new
    conversation, so it gets every replica (in-flight bounds at load_factor 2 alone would
    pile 9 onto its first holder); every later turn stays where its first turn went."""
    p = policy()
    head = chain(640, 1)
    loads: Counter[str] = Counter()
    first: dict[int, str] = {}
    for i in range(16):
        d = p.choose(req(head + chain(8, 100 + i)), views(loads))
        first[i] = d.replica
        loads[d.replica] += 1  # still in flight
    spread = Counter(first.values())
    assert set(spread) == set(NAMES) and max(spread.values()) <= 6, spread
    for i in range(16):  # turn 2 of each: its own history, home
        d = p.choose(req(head + chain(8, 100 + i) + chain(12, 200 + i)), views(loads))
        assert d.replica == first[i]


def test_recent_work_decays_undoes_and_forgets_departed_replicas() -> None:
    w = RecentWork(window=10)
    for _ in range(100):
        w.record("a", 100)
    token = w.record("b", 1000)
    assert math.isclose(w.count("b"), 1000) and w.count("a") < 1000  # a's old work has decayed
    w.undo(token)  # the attempt failed before the replica answered
    assert w.count("b") == 0 and math.isclose(w.total(), w.count("a"))
    w.keep_only({"b"})  # "a" left the pool: its work no longer counts in the mean
    assert w.total() == 0 and w.snapshot() == {"b": 0.0}
    for _ in range(5000):  # renormalises many times without drifting
        w.record("b", 1)
    assert math.isclose(w.total(), 1 / (1 - math.exp(-1 / 10)), rel_tol=1e-6)


def _four_tenants(
    head_blocks: int, queued: int = 0, tenants: int = 4, starts: int = 16, **settings: object
) -> tuple[dict[int, set[str]], dict[str, float]]:
    """Four tenants' heads, new conversations of 8 blocks in turn (the first two heads' first
    holders coincide: a tie in ring order while every replica was idle); where each tenant
    started and each replica's recent prefill work.  ``queued``: prefill tokens waiting on
    every replica (sent, no first token yet) at each decision; ``tenants``: how many heads,
    ``starts``: new conversations behind each.  They are taken for conversations that come
    back (the returns gate off: it has tests of its own below), as agents' are."""
    p = policy(**{"head_copy_min_returns": None, **settings})
    heads = [chain(head_blocks, 10 + t) for t in range(tenants)]
    loads: Counter[str] = Counter()
    placed: dict[int, set[str]] = {t: set() for t in range(tenants)}
    for i in range(starts * tenants):
        t = i % tenants
        fleet = [replace(view, pending_prefill_tokens=queued) for view in views(loads)]
        d = p.choose(req(heads[t] + chain(8, 1000 + i)), fleet)
        placed[t].add(d.replica)
        loads[d.replica] += 1
        if i % 3 == 0:  # some finish
            loads[max(loads, key=loads.__getitem__)] -= 1
    return placed, p.work.snapshot()


def test_a_tenant_among_several_keeps_one_holder() -> None:
    """Each head draws a fair share of starts, so head demand copies none (the fleet's KV
    holds histories, not four copies of heads), even when two heads share a replica.  The
    work balance copies a 6,400-token head only once the traffic it can move pays for it
    (half of its share of the recent work at least the head's length): not within 16 short
    conversations per tenant (the copy would cost more prefill than those conversations
    bring), and after 128 each, the two tenants sharing a replica each start on the replica
    no tenant landed on, once, and the work is within 1.25x the mean."""
    placed, work = _four_tenants(400, start_work_factor=None)
    assert all(len(replicas) == 1 for replicas in placed.values()), placed
    assert max(work.values()) > 1.5 * sum(work.values()) / len(NAMES)  # the replica with two tenants
    placed, _ = _four_tenants(400)
    assert all(len(replicas) == 1 for replicas in placed.values()), placed
    placed, work = _four_tenants(400, starts=128)
    assert set().union(*placed.values()) == set(NAMES), placed
    assert sorted(len(replicas) for replicas in placed.values()) == [1, 1, 2, 2], placed
    assert max(work.values()) <= 1.25 * sum(work.values()) / len(NAMES), work


def test_tenants_sharing_a_replica_are_split_for_prefill_work_balance() -> None:
    """Two tenants on one replica and one replica with none: by default the busiest replica's
    tenants start new conversations on the least-worked replica (gateway.routing.work), so
    every replica works and the recent prefill work stays within 1.25x the mean; off, the
    replica with two tenants does ~2x the mean."""
    _, unbalanced = _four_tenants(40, start_work_factor=None)
    assert max(unbalanced.values()) > 1.5 * sum(unbalanced.values()) / len(NAMES), unbalanced
    placed, work = _four_tenants(40)  # 640-token heads: the imbalance soon outweighs a copy
    assert set().union(*placed.values()) == set(NAMES), placed
    assert max(work.values()) <= 1.25 * sum(work.values()) / len(NAMES), work
    assert sum(len(replicas) for replicas in placed.values()) <= 7, placed  # a few copies, not every head everywhere


def test_a_head_is_copied_only_where_prefill_has_room_for_it() -> None:
    """The same two tenants on one replica, but every replica has more prefill queued than a
    head's 640 tokens (a saturated fleet): a copy would delay the work already waiting there
    by the head's whole prefill, and the imbalance it evens out is no loss while every
    replica is busy, so the balance copies nothing (what moves is the load score's doing,
    late, once the holder has ten more requests in flight).  With a little less queued than
    the head, the balance copies as on an idle fleet."""
    _, busy = _four_tenants(40, queued=2000)
    assert max(busy.values()) > 1.5 * sum(busy.values()) / len(NAMES), busy
    placed, work = _four_tenants(40, queued=600)
    assert set().union(*placed.values()) == set(NAMES), placed
    assert max(work.values()) <= 1.25 * sum(work.values()) / len(NAMES), work


def test_explain_says_whether_a_head_may_be_copied() -> None:
    """``/admin/explain`` (the policy's peek) tells an operator why a new conversation behind a
    shared head did or did not start elsewhere: room for a copy, and whether its traffic pays."""
    p = policy()
    head = chain(40, 9)
    p.index.record("r1", head + chain(4, 1))
    p.index.record("r1", head + chain(4, 2))  # the head is a fork: a request behind it starts
    request = req(head + chain(4, 3))
    busy = [replace(view, pending_prefill_tokens=2000, in_flight=1) for view in views()]
    seen = p.peek(request, busy).detail["shared_head"]
    assert seen["tokens"] == 640 and seen["holders"] == 1 and seen["room_for_a_copy"] is False
    assert seen["traffic_pays_a_copy"] is False  # no recent work at all yet
    idle = p.peek(request, views()).detail["shared_head"]
    assert idle["room_for_a_copy"] is True
    assert "shared_head" not in p.choose(request, views()).detail  # real requests skip it


def test_an_idle_holder_keeps_one_at_a_time_requests() -> None:
    """One request at a time behind a shared system prompt: nothing is gained by computing the
    head elsewhere while its holder is idle."""
    p = policy()
    head = chain(40, 2)
    picks = {p.choose(req(head + chain(4, 300 + i)), views({})).replica for i in range(12)}
    assert len(picks) == 1


def test_off_the_holder_takes_them_until_its_load_bound() -> None:
    p = policy(head_load_factor=None)
    head = chain(640, 1)
    loads: Counter[str] = Counter()
    for i in range(16):
        loads[p.choose(req(head + chain(8, 100 + i)), views(loads)).replica] += 1
    assert max(loads.values()) >= 8  # piled on the head's holder


def test_a_failed_start_is_taken_back() -> None:
    p = policy()
    head = chain(30, 9)
    p.index.record("r1", head + chain(4, 1))
    p.index.record("r1", head + chain(4, 2))  # the head is a fork: a request behind it starts
    request = req(head + chain(4, 3))
    d = p.choose(request, views({}))
    assert d.detail["started"] and math.isclose(p.demand.recent_starts(), 1.0)
    p.forget_attempt(request, d)
    assert p.demand.recent_starts() == 0
    assert p.snapshot()["starts"]["recent_starts"] == 0


def test_a_joining_process_takes_its_peers_counts_without_counting_twice_what_it_heard_live() -> None:
    peer, newcomer = HeadDemand(256), HeadDemand(256)
    for head in [1] * 12 + [2] * 4:
        peer.record(head)
    for head in [1] * 3:  # the last of those reached the newcomer live before the snapshot did
        newcomer.record_peer(head)
    newcomer.merge(*peer.export(8))
    assert math.isclose(newcomer.recent_starts(), peer.recent_starts(), rel_tol=1e-9)
    assert math.isclose(newcomer.share(1, prior=1), peer.share(1, prior=1), rel_tol=1e-9)
    assert math.isclose(newcomer.share(2, prior=1), peer.share(2, prior=1), rel_tol=1e-9)


def test_a_return_is_a_later_turn_that_continues_a_start() -> None:
    """A start opens its prompt's last keys; a request whose match ends within a stride of one
    is its next turn (counted, and it opens its own end for the turn after); a request that
    only shares the head is not; the rate leans on the prior until starts are seen."""
    r = StartReturns(window=10**9)
    assert r.rate() == 1.0 and r.prior == 8  # nothing seen: one return per start, the prior
    head = chain(40, 1)
    turn1 = head + chain(6, 2)
    r.started(turn1)
    other = head + chain(6, 3)
    assert not r.returned(other, depth=40, stride=8)  # shares the head only
    turn2 = turn1 + chain(5, 4)
    assert r.returned(turn2, depth=44, stride=8)  # matched at a stride key below turn 1's end
    assert not r.returned(turn1 + chain(5, 6), depth=44, stride=8)  # turn 1's end is closed now...
    assert r.returned(turn2 + chain(3, 5), depth=51, stride=8)  # ...and turn 2's is open: turn 3
    assert math.isclose(r.rate(), 10 / 9, rel_tol=1e-6)  # two returns for one start, and the prior's
    for i in range(30):
        r.started(head + chain(6, 100 + i))  # one-shot starts: nothing comes back
    assert r.rate() < 0.5
    assert r.snapshot()["recent_returns"] == 2.0


def test_a_named_flows_rate_is_its_own_with_the_pools_as_its_prior() -> None:
    """A batch tenant's one-shot starts beside a chat tenant's conversations: the pool's rate
    mixes them, each named flow's rate is its own record (the pool's rate weighs as the
    prior's 8 starts), and a return counts for the flow whose conversation it continues."""
    r = StartReturns(window=10**9, max_flows=2)
    head = chain(40, 11)
    for i in range(12):  # chat: conversations whose second turns come back
        turn = head + chain(6, 200 + i)
        r.started(turn, "id:chat")
        assert r.returned(turn + chain(5, 300 + i), depth=44, stride=8)
    for i in range(12):  # batch: one-shot starts
        r.started(chain(40, 12) + chain(6, 400 + i), "id:batch")
    pool = r.rate()
    assert math.isclose(pool, (12 + 8) / (24 + 8), rel_tol=1e-6)  # 0.625: the pool still says "commits"
    assert math.isclose(r.rate("id:chat"), (12 + 8 * pool) / (12 + 8), rel_tol=1e-6)
    assert math.isclose(r.rate("id:batch"), 8 * pool / (12 + 8), rel_tol=1e-6)  # 0.25: it does not
    assert r.rate("id:new") == pool and r.rate(None) == pool  # no record: the pool's
    assert r.snapshot()["flows_tracked"] == 2
    r.started(chain(40, 13) + chain(6, 500), "id:third")  # bounded: the oldest flow is forgotten
    assert r.snapshot()["flows_tracked"] == 2 and r.rate("id:chat") == r.rate()


def test_a_one_shot_tenants_starts_commit_nothing_beside_a_chatty_tenant() -> None:
    """Beside a tenant whose conversations come back, the pool's rate says starts commit load;
    a batch tenant whose earlier job's starts never came back reads its own record, so its
    next request behind the job's document is no start that commits (no copy for load); the
    same traffic sent anonymously reads the pool's rate, as before."""

    def shared_head(flow: str | None) -> dict[str, object]:
        p = policy(head_window_starts=64)
        chat_head = chain(640, 21)
        for i in range(24):  # the chat tenant's conversations, each with its next turn
            own = chat_head + chain(8, 600 + i)
            p.choose(replace(req(own), flow="id:chat"), views())
            p.choose(replace(req(own + chain(4, 700 + i)), flow="id:chat"), views())
        document = chain(640, 22)
        _burst(p, document, 12, seed=800, flow=flow)  # the batch tenant's job: one-shot starts
        assert p.returns.rate() >= 0.5  # the pool's rate says starts commit
        busy = [replace(view, in_flight=3) for view in views()]
        return p.peek(replace(req(document + chain(8, 900)), flow=flow), busy).detail["shared_head"]

    assert shared_head("id:batch")["starts_commit_load"] is False
    assert shared_head(None)["starts_commit_load"] is True


def _burst(
    p: PrefixPolicy,
    head: tuple[int, ...],
    n: int,
    seed: int,
    queued: int = 0,
    turns: bool = False,
    flow: str | None = None,
) -> Counter[str]:
    """``n`` requests behind ``head`` all in flight at once; ``turns``: each start's next turn
    (its own history) follows it, as a conversation's does; ``flow``: the flow they name.
    Where the starts went."""
    loads: Counter[str] = Counter()
    placed: Counter[str] = Counter()
    for i in range(n):
        fleet = [replace(view, pending_prefill_tokens=queued) for view in views(loads)]
        own = head + chain(8, seed + i)  # (keys stand for a chain: each burst's own)
        d = p.choose(replace(req(own), flow=flow), fleet)
        placed[d.replica] += 1
        loads[d.replica] += 1
        if turns:
            p.choose(req(own + chain(4, seed + 500 + i)), views(loads))
    return placed


def test_a_head_whose_starts_never_come_back_is_not_copied_for_them() -> None:
    """A batch job mapping one 10k-token document: every request behind it is a start that never
    comes back, so spreading them commits no later load and each copy costs the document's whole
    prefill.  Once the pool has seen such starts (an earlier job) the head rules stop copying:
    the burst stays on its holder up to the load bound, where the same bursts sent as
    conversations (each start's next turn follows) still spread over the fleet.  (A short
    window: the earlier job's starts do not dilute the new head's share.)"""
    p = policy(head_window_starts=8)
    _burst(p, chain(640, 7), 24, seed=1000)  # an earlier job: the pool learns its starts are one-shot
    placed = _burst(p, chain(640, 8), 16, seed=2000)
    assert p.snapshot()["start_returns"]["returns_per_start"] < 0.5
    assert len(placed) <= 2 and max(placed.values()) >= 8, placed
    conversations = policy(head_window_starts=8)
    _burst(conversations, chain(640, 7), 24, seed=1000, turns=True)
    placed = _burst(conversations, chain(640, 8), 16, seed=2000, turns=True)
    assert conversations.snapshot()["start_returns"]["returns_per_start"] >= 0.5
    assert len(placed) >= 3 and max(placed.values()) <= 6, placed


def test_a_one_shot_head_is_still_copied_when_the_copy_saves_the_wait() -> None:
    """Without returns a copy must pay for itself, as a spill does: once the holder has more
    prefill queued than the least-queued replica plus the head plus ``spill_min_saving`` (3) x
    the head, computing the head elsewhere saves more wait than it recomputes, so the next
    start goes elsewhere; with less queued it stays.  (A copy that saves less — 3,000 tokens
    queued against 1,280 to compute: the first request's tail, say — is not made; with
    ``spill_min_saving: null`` any saving buys it, as before.)"""
    head = chain(80, 9)  # 1,280 tokens

    def setup(**settings: object) -> tuple[PrefixPolicy, set[str]]:
        p = policy(head_window_starts=8, **settings)
        _burst(p, chain(80, 7), 16, seed=3000)  # an earlier job: the pool learns its starts are one-shot
        holders = set(_burst(p, head, 6, seed=1000))  # one-shot starts behind the head
        assert len(holders) < len(NAMES)
        return p, holders

    def fleet(queued: int) -> list[ReplicaView]:
        return [
            replace(view, in_flight=2, pending_prefill_tokens=queued if view.name in holders else 0) for view in views()
        ]

    p, holders = setup()
    request = req(head + chain(4, 3))
    seen = p.peek(request, fleet(1000)).detail["shared_head"]
    assert seen["starts_commit_load"] is False and seen["copy_saves_wait"] is False  # 1000 < 0 + 1280
    assert p.choose(request, fleet(1000)).replica in holders
    request = req(head + chain(4, 4))
    assert p.peek(request, fleet(3000)).detail["shared_head"]["copy_saves_wait"] is False  # 3000 < 0 + 4 x 1280
    assert p.choose(request, fleet(3000)).replica in holders
    request = req(head + chain(4, 5))
    assert p.peek(request, fleet(6000)).detail["shared_head"]["copy_saves_wait"] is True  # 6000 > 0 + 4 x 1280
    assert p.choose(request, fleet(6000)).replica not in holders
    p, holders = setup(spill_min_saving=None)
    request = req(head + chain(4, 6))
    assert p.peek(request, fleet(3000)).detail["shared_head"]["copy_saves_wait"] is True  # 3000 > 0 + 1280
    assert p.choose(request, fleet(3000)).replica not in holders


def test_a_flows_own_backlog_does_not_buy_a_copy_of_its_head() -> None:
    """The copy-saves-wait rule counts only the other flows' work on the holders when the client
    names its flow: a batch tenant's burst queued on its document's holder waits behind itself,
    instead of recomputing the document in front of the other tenants' requests elsewhere.
    The same backlog from another flow, from an anonymous client (one flow per route), or with
    ``head_copy_own_flow_wait`` on still buys the copy."""
    head = chain(80, 9)  # 1,280 tokens

    def setup(**settings: object) -> tuple[PrefixPolicy, set[str]]:
        p = policy(head_window_starts=8, **settings)
        # an earlier job: the pool learns its starts are one-shot
        _burst(p, chain(80, 7), 16, seed=3000, flow="id:batch")
        holders = set(_burst(p, head, 6, seed=1000, flow="id:batch"))
        p.choose(replace(req(chain(20, 77)), flow="id:chat"), views())  # another tenant on the route
        return p, holders

    def fleet(holders: set[str], by_flow: dict[str, int]) -> list[ReplicaView]:
        queued = sum(by_flow.values())
        return [
            replace(view, in_flight=2, pending_prefill_tokens=queued, pending_prefill_by_flow=by_flow)
            if view.name in holders
            else replace(view, in_flight=2)
            for view in views()
        ]

    def copied(p: PrefixPolicy, holders: set[str], flow: str | None, by_flow: dict[str, int], n: int) -> bool:
        """Whether the request would start off the head's holders (peeked: each case alike)."""
        decision = p.peek(replace(req(head + chain(4, n)), flow=flow), fleet(holders, by_flow))
        assert decision.detail["shared_head"]["copy_saves_wait"] is (decision.replica not in holders)
        return decision.replica not in holders

    p, holders = setup()
    assert len(holders) < len(NAMES)
    assert not copied(p, holders, "id:batch", {"id:batch": 6000}, 1)  # its own burst: it waits
    explained = p.peek(replace(req(head + chain(4, 1)), flow="id:batch"), fleet(holders, {"id:batch": 3000}))
    assert explained.detail["shared_head"]["own_flow_queued_on_holders"] == 3000 * len(holders)
    # (a copy must save 3 x the head it recomputes: holders' queue over 0 + 4 x 1280 = 5120)
    assert not copied(p, holders, "id:batch", {"id:batch": 5000, "id:chat": 4000}, 2)  # others' 4000 < 5120
    assert copied(p, holders, "id:batch", {"id:batch": 1000, "id:chat": 6000}, 3)  # others' 6000 > 5120
    assert copied(p, holders, "id:chat", {"id:batch": 6000}, 4)  # another flow's backlog
    assert copied(p, holders, None, {"id:batch": 6000}, 5)  # anonymous: every queued token counts
    p, holders = setup(head_copy_own_flow_wait=True)
    assert copied(p, holders, "id:batch", {"id:batch": 6000}, 6)
    # the route's only flow (one client key): its copy runs in front of nobody else's requests
    alone = policy(head_window_starts=8)
    _burst(alone, chain(80, 7), 16, seed=3000, flow="id:batch")
    holders = set(_burst(alone, head, 6, seed=1000, flow="id:batch"))
    assert copied(alone, holders, "id:batch", {"id:batch": 6000}, 8)
    # what peek said, choose does (each judges the recent flows before the request counts)
    p, holders = setup()
    request = replace(req(head + chain(4, 9)), flow="id:batch")
    assert p.choose(request, fleet(holders, {"id:batch": 3000})).replica in holders


def test_a_holder_over_its_load_bound_is_a_spill_not_a_copy_that_saves_the_wait() -> None:
    """Every holder over its load bound: the request goes elsewhere whatever the copy rules say,
    and explain must not report a copy that saves the wait (no holder could have served it)."""
    p = policy(head_window_starts=8)
    head = chain(80, 9)
    _burst(p, chain(80, 7), 16, seed=3000)
    holders = set(_burst(p, head, 6, seed=1000))
    fleet = [replace(view, in_flight=40 if view.name in holders else 0) for view in views()]
    decision = p.peek(req(head + chain(4, 1)), fleet)
    assert decision.replica not in holders
    assert decision.detail["shared_head"]["copy_saves_wait"] is False


def test_peek_and_choose_agree_at_the_edge_of_the_recent_flows_window() -> None:
    """The last other-flow request is exactly at the window's edge: peek (explain, flow
    control's preferred replica) and choose must place the request alike."""
    head, window = chain(80, 9), 64
    p = policy(head_window_starts=8, start_work_window=window)
    _burst(p, chain(80, 7), 16, seed=3000, flow="id:batch")
    holders = set(_burst(p, head, 6, seed=1000, flow="id:batch"))
    p.choose(replace(req(chain(20, 77)), flow="id:chat"), views())
    for _ in range(window - 1):
        p.flows.seen("id:batch")
    fleet = [
        replace(view, in_flight=2, pending_prefill_tokens=3000, pending_prefill_by_flow={"id:batch": 3000})
        if view.name in holders
        else replace(view, in_flight=2)
        for view in views()
    ]
    request = replace(req(head + chain(4, 1)), flow="id:batch")
    assert (p.peek(request, fleet).replica in holders) == (p.choose(request, fleet).replica in holders)


def test_the_own_flow_rule_reads_the_replicas_counts_through_the_runner() -> None:
    """Real replicas and the route runner's live views: a charge named for a flow is what the
    rule subtracts (the only way production code reaches the per-flow counts)."""

    def stays_on_holders(flow: str | None, **settings: object) -> bool:
        replicas = [
            Replica(ReplicaConfig(name=name, url=f"http://h:{i}"), None, HealthSettings())  # type: ignore[arg-type]
            for i, name in enumerate(NAMES)
        ]
        runner = PolicyRunner("route", "prefix", policy(head_window_starts=8, **settings), replicas)

        def burst(head: tuple[int, ...], n: int, seed: int) -> set[str]:
            placed = set()
            for i in range(n):
                decision, replica = runner.decide(replace(req(head + chain(8, seed + i)), flow="id:batch"))
                replica.in_flight += 1
                placed.add(decision.replica)
            return placed

        head = chain(80, 9)
        burst(chain(80, 7), 16, 3000)
        holders = burst(head, 6, 1000)
        runner.decide(replace(req(chain(20, 77)), flow="id:chat"))
        for replica in replicas:
            replica.in_flight = 2
            if replica.name in holders:
                replica.charge_prefill(6000, "id:batch")  # over 0 + 4 x the 1,280-token head: a copy pays
        decision, _ = runner.decide(replace(req(head + chain(4, 1)), flow=flow))
        return decision.replica in holders

    assert stays_on_holders("id:batch")  # its own backlog: it waits
    assert not stays_on_holders("id:chat")  # another flow's backlog: copied
    assert not stays_on_holders(None)  # anonymous: copied, as before
    assert not stays_on_holders("id:batch", head_copy_own_flow_wait=True)


def test_recent_flows_say_whether_another_flow_shares_the_route() -> None:
    flows = RecentFlows(window=4, max_flows=2)
    assert not flows.others_within("id:a")
    flows.seen("id:a")
    flows.seen("id:a")
    assert not flows.others_within("id:a") and flows.others_within("id:b")
    flows.seen(None)  # an anonymous request is another flow
    assert flows.others_within("id:a")
    for _ in range(4):
        flows.seen("id:a")
    assert not flows.others_within("id:a")  # the anonymous one is 4 requests back: out of the window
    flows.seen("id:b")
    flows.seen("id:c")  # bounded: the oldest flow is forgotten
    assert list(flows._last) == ["id:b", "id:c"]


def test_a_one_shot_request_behind_a_short_head_is_not_queued_behind_its_busy_holders() -> None:
    """Starts that do not come back (RAG questions): a new request behind a short shared head
    goes where it is answered soonest, its queued prefill counted though another replica holds
    the head (``one_shot_queue_gap_tokens``).  Measured on ``rag``: three holders of a 688-token
    preamble with 30k tokens queued each took every question while the fourth sat idle.
    Conversations (their starts come back), a long head, or the setting off: the holders keep it."""
    head = chain(43, 9)  # 688 tokens

    def decide(turns: bool, head_keys: tuple[int, ...] = head, **settings: object) -> str:
        p = policy(**settings)
        _burst(p, chain(80, 7), 16, seed=3000, turns=turns)  # the pool learns whether starts return
        for i, name in enumerate(("r1", "r2", "r3")):  # the head behind three earlier questions
            p.index.record(name, head_keys + chain(8, 100 + i))
        busy = [
            replace(view, in_flight=10, pending_prefill_tokens=30_000) if view.name != "r0" else view
            for view in views()
        ]
        decision = p.peek(req(head_keys + chain(8, 200)), busy)
        assert decision.detail["shared_head"]["starts_commit_load"] is turns
        # explain says whether the queue counted for it
        assert decision.detail["prefill_queue_weight"] == (1.0 if decision.replica == "r0" else 0.0)
        return decision.replica

    assert decide(turns=False) == "r0"
    assert decide(turns=False, one_shot_queue_gap_tokens=None) != "r0"
    assert decide(turns=True) != "r0"  # a conversation's start: where its later turns will find it
    assert decide(turns=False, head_keys=chain(80, 9)) != "r0"  # 1,280 tokens: over the gap
