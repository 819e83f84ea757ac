"""The ``prefix`` policy: send a request where its prefix is cached, without hot spots.

Inputs are the request's chained keys (the whole prompt, see :mod:`gateway.prefix`), its
whole prompt length (estimated past the window), and each eligible replica's in-flight count
and queued prefill (uncached prompt tokens of requests sent there that have no first byte
yet, counted by the gateway).  Cached and queued work are compared in one unit, tokens: a
new request's time to first token is roughly the prefill queued ahead of it plus its own
uncached tokens.  The decision, in order:

1. **Load bound (CHWBL).**  Replica *r* may take the request only while
   ``in_flight_r < ceil(c x (total_in_flight + 1) x w_r / W)`` (c = ``load_factor``), plus
   ``bound_extra`` (4) if *r* holds at least ``bound_extra_min_tokens`` (1,024) of this prompt:
   the textbook bound pushes a long conversation off its replica at low load (two other
   requests there are enough), recomputing thousands of tokens to save a short wait, while
   short popular prefixes must not pile up.  Some replica is always under its bound, so the
   bound is never exceeded — except that a spill must pay for what it recomputes
   (``spill_min_saving``): when every replica holding the most of the prompt (at least
   ``bound_extra_min_tokens``) is over its bound, the least busy of them keeps the request
   unless another replica's estimated wait is shorter by more than 3 x the tokens it would
   compute again, up to twice its bound (:meth:`PrefixPolicy._keep_over_bound`).
2. **Affinity.**  The affinity index gives each replica the depth (in keys) of the longest
   prefix of this request it recently served, and whether an earlier prompt ended there.
   Keys cover the whole prompt (token blocks over the window, then text chunks, see
   :mod:`gateway.prefix.pipeline`), so a depth converts to cached tokens exactly for token
   blocks and by a character estimate past them.  If an under-bound replica has a match:

   - **home**: the deepest match among under-bound replicas is on one replica and no other
     prompt went on differently after it (not a fork: this conversation's own history):
     stay (``sticky_homes``).  The bound guards hot spots; a score would move a conversation
     behind a long shared head for a few tokens of load difference.
   - **start**: the deepest match is a fork — a prefix other prompts went on from
     differently (a new conversation behind a tenant's system prompt).  The conversation
     will stay where it starts; the head gets as many holders as its share of recent starts
     needs (``head_load_factor``, :mod:`gateway.routing.starts`).  While it has fewer, every
     holder is busy and some replica has less prefill queued than the head (room to compute
     a copy without delaying what waits there), the request starts on another replica (the
     ring branch: least busy), which computes the head; else the score below (the head's
     holders win).
   - **balance**: such a start behind a head whose traffic pays for a copy (half its share
     of recent starts x the recent prefill work is at least the head's length: a copy moves
     about half of this head's later work, so a long head that few requests follow is not
     copied; measured: a 55k-token document of the synthetic trace copied for 2 points of
     hit rate), whose holder has done more than ``start_work_factor``
     (1.25) x the mean recent prefill work, and more than the mean + the head's length, goes
     to the least-worked holder under that, else to the least-worked replica with less
     prefill queued than the head, which computes the head (:mod:`gateway.routing.work`):
     tenants do not divide evenly over replicas.  A copy is made only where it has room: on
     a fleet where every replica has more than the head queued (saturated), it would delay
     the work already waiting by the head's whole prefill and add that much to the fleet's
     work, while the imbalance it evens out costs nothing while every replica is busy
     (measured: a batch job's burst copied its document to 2-4 replicas).
   - **shared** (opt-in, ``shared_prefix_slack``): such a request's best holder keeps it
     while it is the least busy (+ ``shared_prefix_slack`` requests; in-flight plus queued
     prefill); else the least busy replica takes it and caches the prefix too: a hot head is
     replicated at every busy moment (costs hit rate; off by default).
   - **score** otherwise: the under-bound replica with the best ``cached_tokens -
     load_cost_tokens x load - prefill_queue_weight x queued_prefill`` (both per unit of
     weight).  The queued-prefill term only counts while every under-bound replica holds the
     same cached prefix (within a block): it never pulls a request away from more of its
     prompt, which the fleet would have to recompute.

   Reason ``affinity`` (the chosen replica has the deepest match overall) or ``spill`` (a
   deeper match sits on a replica that was over its bound, too busy, or the shared head was
   replicated).
3. **Ring.**  No under-bound replica has a match: walk the consistent-hash ring from the
   request's key (the chain key at ``key_depth_tokens``, or the session key) and take the
   first under-bound replica whose load (the same in-flight and queued-prefill cost) is at
   most the least + ``ring_slack`` requests.  With the default slack 0 a request that shares
   nothing goes to the replica with the least work ahead of it (only ties follow the ring,
   so idle fleets still agree across gateway processes); a larger
   slack, or ``null`` (pure CHWBL), trades load balance for placement that several gateway
   processes agree on without sharing state.  Reason ``ring`` when nothing of the prompt is
   cached anywhere (the pick is where load puts it: no cache is lost, so it is no spill); with
   pure CHWBL ``ring`` is the key's home and leaving it, over its bound, is a ``spill``; and
   ``spill`` whenever some of the prompt sat on replicas that could not take it.
4. **Fallback.**  No keys at all (prompt shorter than one block, embeddings): least loaded.

Every choice is recorded in the affinity index *at decision time* (a burst of requests with a
new shared prefix follows the first one instead of scattering; not one whose prompt is estimated
past its model's ``max_model_len``, which its engine refuses) and taken back, here and on the
peers, if the replica does not serve it — no 2xx answer (``forget_attempt``) — and every tie is broken by
the ring order of the request's own key — its session header, else its deepest key, never a
shared head's key and never list position — so gateway processes with the same membership
and state choose the same replica, and conversations behind one head spread.

``Decision.detail`` carries ``predicted_cached_tokens`` and everything ``/admin/explain``
shows.  No HTTP, metrics or logging here.  Beside this module: the settings
(:mod:`~gateway.routing.policies.prefix_settings`), how many prompt tokens a request's keys
cover (:mod:`~gateway.routing.policies.prefix_keys`), the per-group fleet view the decision
reads load from (:mod:`~gateway.routing.policies.prefix_fleet`) and the explain-only
candidate table (:mod:`~gateway.routing.policies.prefix_explain`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, ClassVar

from gateway.prefix.block_size import DEFAULT_BLOCK_SIZE
from gateway.routing.affinity import AffinityIndex
from gateway.routing.base import Decision, ReplicaView, RequestView
from gateway.routing.decay import Token
from gateway.routing.flows import RecentFlows
from gateway.routing.load import FleetLoad, fleet_load
from gateway.routing.policies.prefix_explain import candidate_table
from gateway.routing.policies.prefix_fleet import LIST_AT_MOST, Cheapest, Cost, DecisionFleet, Group
from gateway.routing.policies.prefix_keys import beyond_window, depth_tokens, ring_key_of, token_blocks
from gateway.routing.policies.prefix_settings import PrefixPolicySettings
from gateway.routing.precise import PreciseMatcher
from gateway.routing.returns import StartReturns
from gateway.routing.ring import HashRing
from gateway.routing.starts import HeadDemand
from gateway.routing.work import RecentWork


def _over_context(request: RequestView) -> bool:
    """Whether the prompt's estimated length is past its model's ``max_model_len``: vLLM answers
    it 400 and caches nothing.  Recorded, it would push the model's oldest records out (a
    191k-token prompt over a 131k context: the tails of every conversation on that replica),
    and taking the record back on the 400 returns only the keys it added, not those it pushed
    out (measured: benchmarks/README.md, "Prompts over the context").  The gateway still sends
    it (the estimate is no certainty, see :mod:`gateway.limits.context`)."""
    limit = request.context_limit
    if limit is None:
        return False
    return (request.prompt_tokens_estimate or request.prompt_tokens or 0) > limit


def _nothing_own(slot: int) -> int:
    """No flow's own work counts apart (an anonymous request, or head_copy_own_flow_wait on)."""
    return 0


REASONS = ("affinity", "ring", "spill", "fallback")

__all__ = ["REASONS", "PrefixPolicy", "PrefixPolicySettings"]  # the settings: re-exported


class PrefixPolicy:
    """Consistent hashing with bounded loads plus a prefix-affinity index."""

    name: ClassVar[str] = "prefix"
    settings_model: ClassVar[type[PrefixPolicySettings]] = PrefixPolicySettings

    def __init__(self, settings: PrefixPolicySettings, members: Sequence[ReplicaView]) -> None:
        self.settings = settings
        self._weights: dict[str, float] = {}
        self.ring = HashRing({}, settings.virtual_nodes)
        self.index = AffinityIndex(
            settings.affinity_max_entries,
            settings.stride_for(DEFAULT_BLOCK_SIZE),  # until the route's block size is known
            max_bytes=settings.affinity_max_bytes,
        )
        self._weights_block_size = 0  # the block size the index's standard key weight is set for
        self.demand = HeadDemand(settings.head_window_starts)
        self.returns = StartReturns(settings.head_window_starts)
        self.work = RecentWork(settings.start_work_window)
        self.flows = RecentFlows(settings.start_work_window)  # the own-flow copy rule: are there others?
        self._weight_sum = 0.0
        self._turn = 0
        self._withdrawals = 0  # forget_attempt calls that took keys back (see observe)
        self._admitted: FleetLoad | None = None  # the live load whose names are all on the ring
        self._bits_cache: tuple[FleetLoad, int, int, list[int]] | None = None
        # Replicas whose engines publish KV events are matched from what they hold (attached
        # by the gateway, see gateway.kv_events); None: the affinity index's model only.
        self.precise: PreciseMatcher | None = None
        self.set_members(members)

    def attach_precise(self, matcher: PreciseMatcher | None) -> None:
        """Match precise replicas through ``matcher`` from now on (None: the model only)."""
        self.precise = matcher

    # -- membership --------------------------------------------------------------------
    def set_members(self, members: Sequence[ReplicaView]) -> None:
        """Rebuild the ring only when names or weights changed; forget replicas that left."""
        weights = {m.name: float(m.weight) for m in members}
        if weights != self._weights:
            self._weights = weights
            self._weight_sum = sum(weights.values())
            self.ring = HashRing(weights, self.settings.virtual_nodes)
            self.work.keep_only(set(weights))
        self.index.set_members(weights)
        self._model_caches(members)
        self._admitted = None

    def _model_caches(self, members: Sequence[ReplicaView]) -> None:
        """Size each replica's modelled prefix cache (``replica_cache_tokens``)."""
        tokens = self.settings.replica_cache_tokens
        if tokens is None:
            return
        for member in members:
            self.index.set_token_capacity(member.name, member.kv_cache_tokens if tokens == "auto" else tokens)

    def _admit(self, load: FleetLoad) -> None:
        """A replica the runner offers but ``set_members`` never named joins the ring (checked
        once per live load: its names change only with a new one)."""
        if load is self._admitted:
            return
        weights = load.weights
        missing = {name: weights[i] for i, name in enumerate(load.names) if name not in self._weights}
        if missing:
            weights_now = {**self._weights, **missing}
            self._weights = weights_now
            self._weight_sum = sum(weights_now.values())
            self.ring = HashRing(weights_now, self.settings.virtual_nodes)
            self.index.set_members(weights_now)
        self._admitted = load

    def _eligible_bits(self, load: FleetLoad) -> tuple[int, list[int]]:
        """The affinity index's mask of the eligible replicas and each one's bit, kept while
        both stay the same (a live load lasts from one health event to the next)."""
        cached = self._bits_cache
        generation = self.index.generation
        if cached is not None and cached[0] is load and cached[1] == generation:
            return cached[2], cached[3]
        bits: list[int] = []
        for name in load.names:
            bit = self.index.slot_of(name)
            assert bit is not None  # _admit made every eligible replica a member of the index
            bits.append(bit)
        mask = self.index.mask_of(load.names)
        self._bits_cache = (load, generation, mask, bits)
        return mask, bits

    # -- the decision ------------------------------------------------------------------
    def choose(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        """Decide and record the placement in the affinity index."""
        decision = self._decide(request, replicas, commit=True)
        # counted after deciding: peek and choose judge the same recent flows (gateway.routing.flows)
        self.flows.seen(request.flow)
        return decision

    def peek(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        """What :meth:`choose` would decide now, changing nothing (``/admin/explain``).

        The affinity index is not touched and the fallback tie-break turn does not advance,
        so the next real request is placed exactly as if the peek had never happened.  (A
        replica the runner offers that was never named still joins the ring: membership,
        which ``choose`` would sync the same way, not per-request state.)
        """
        return self._decide(request, replicas, commit=False)

    def _decide(self, request: RequestView, replicas: Sequence[ReplicaView], commit: bool) -> Decision:
        # Nothing here passes over every replica (see "Route cost" in docs/prefix-routing.md):
        # fleet-wide numbers come from the runner's live load, the affinity index answers by
        # group (replicas holding the same prefix), and each group's best replica is found
        # through the load's sorted orders (gateway/routing/policies/prefix_fleet.py).
        load = fleet_load(replicas)
        self._admit(load)
        settings = self.settings
        keys = request.block_keys
        block_size = request.block_size or 1
        ring_key, key_source, key_depth = ring_key_of(request, settings.use_session_key, settings.key_depth_tokens)
        if ring_key is None:
            turn = self._turn + 1
            if commit:
                self._turn = turn
            pick = load.names[load.least_loaded(turn)]
            return Decision(pick, "fallback", {"predicted_cached_tokens": 0, "key_source": "none"})
        self._sync_block_size(block_size)
        # A prompt estimated past the model's context is refused by its engine: placed, recorded nowhere
        over_context = _over_context(request)
        record = commit and not over_context

        want, bits = self._eligible_bits(load)
        fleet = DecisionFleet(load, settings.load_factor, bits, self.index.name_of)
        precise = self.precise
        found = None
        if precise is not None and keys:
            found = precise.match_groups(self.index, request, want, lambda name: load.pending[load.index[name]])
        if found is None:
            found = self.index.match_groups(keys, want) if keys else []
        best_any = found[0][0] if found else 0
        groups = self._groups(request, found)  # most of the prompt held first
        held = 0
        for _, mask in found:
            held |= mask
        free = Group(0, 0, want & ~held)  # eligible replicas holding none of the prompt
        under = [group for group in groups if fleet.admitted_members(group, 1)]  # groups with a replica under its bound
        any_free = bool(fleet.admitted_members(free, 1))
        kept_over_bound = False
        if groups and (not under or under[0] is not groups[0]) and settings.spill_min_saving is not None:
            # every replica holding the most of the prompt is over its bound: spill only where it saves the wait
            spare = free if any_free else None
            own = self._own_queued(request, replicas)
            kept_over_bound = self._keep_over_bound(request, fleet, groups[0], under, spare, own)
            if kept_over_bound:
                under.insert(0, groups[0])
        if not under and not any_free:  # impossible with load_factor >= 1; stay total anyway
            fleet.all_under = True
            under, any_free = list(groups), bool(free.mask)
        has_match = bool(under)
        home = self._home(keys, fleet, under) if has_match and settings.sticky_homes else None
        # A new conversation behind a shared head (its deepest match is a fork) stays where it
        # starts: the head gets as many holders as its share of recent starts needs (see
        # gateway.routing.starts); while it has fewer and every holder is busy, start elsewhere.
        # the deepest match is a prefix other prompts went on from differently (a shared head)
        forked = bool(best_any) and self.index.forks_at(keys, best_any)
        factor = settings.head_load_factor
        start: int | None = None  # the shared head behind a new conversation
        one_shot = False  # ... whose starts do not come back for later turns
        balance: str | None = None  # where it starts instead, for prefill-work balance
        head_view: dict[str, Any] | None = None  # explain only: why the head was (not) copied
        counts_returns = record and settings.head_copy_min_returns is not None  # (off: nothing reads them)
        if counts_returns:  # a later turn of a conversation started behind a shared head (gateway.routing.returns)
            self.returns.returned(keys, best_any, self.index.stride)
        if factor is not None and home is None and forked:
            start = keys[best_any - 1]
            holders = [group for group in groups if group.depth == best_any]
            own_queued = self._own_queued(request, replicas)
            prior = settings.head_min_starts or 2 * load.n
            needed = self.demand.holders_needed(start, load.n, factor, prior)
            head_tokens = holders[0].tokens if holders else 0
            holding = sum(group.size for group in holders)
            # copies for the load a start commits only while starts come back for more turns
            commits = self._starts_commit(request.flow)
            one_shot = not commits
            if (
                holding < needed
                and not any(fleet.idle_member(g) for g in holders)
                and fleet.has_room_for(head_tokens)
                and (commits or self._copy_saves_wait(fleet, holders, head_tokens, own_queued))
            ):
                elsewhere = [group for group in under if group.depth != best_any]
                if elsewhere or any_free:
                    under = elsewhere
                    has_match = bool(under)
            elif (
                settings.start_work_factor is not None
                and commits
                and self.demand.recent_starts() + 1 >= prior
                and self._copy_pays(start, prior, head_tokens)
            ):
                own_key = ring_key if key_source == "session" else keys[-1]
                balance = self._least_worked(fleet, holders, head_tokens, settings.start_work_factor, own_key)
            if not commit:
                head_view = {
                    "tokens": head_tokens,
                    "holders": holding,
                    "holders_needed": needed,
                    "room_for_a_copy": fleet.has_room_for(head_tokens),
                    "traffic_pays_a_copy": self._copy_pays(start, prior, head_tokens),
                    "starts_commit_load": commits,
                    "copy_saves_wait": self._copy_saves_wait(fleet, holders, head_tokens, own_queued),
                    "own_flow_queued_on_holders": sum(own_queued(slot) for g in holders for slot in fleet.members(g)),
                }
        # Ties break on this request's own identity — its session, or its deepest key (which
        # covers the whole prompt) — never on a shared head's key: conversations behind one
        # long system prompt spread instead of following that prompt's key to one replica.
        tie_key = ring_key if key_source == "session" else keys[-1]

        # The prefill already waiting on each replica (tokens per unit of weight), as a cost in
        # cached tokens — but only while the replicas that may take the request hold the same
        # cached prefix of it (within a block): queued work picks the shortest wait among
        # equally good caches and never pulls a request away from more of its prompt, which
        # the fleet would recompute (measured: that trade loses more hits than it saves time).
        # A one-shot request behind a short head is the exception (see _queue_gap).
        queue_weight = settings.prefill_queue_weight
        if queue_weight and under:
            cached_under = [group.tokens for group in under]
            if max(cached_under) - (0 if any_free else min(cached_under)) >= self._queue_gap(block_size, one_shot):
                queue_weight = 0.0
        shared_slack = settings.shared_prefix_slack
        others = [*under, free] if any_free else under
        if home is not None:
            # A conversation's next turn: its history ends on this replica (under its
            # bound).  Stay: the bound, not a score, guards against hot spots.
            branch = "home"
            pick = home
        elif balance is not None:
            # A new conversation whose head's holders have all done much more than their share
            # of recent prefill work: start it where the least was done (see gateway.routing.work).
            branch = "balance"
            pick = balance
        elif has_match and shared_slack is not None and forked:
            branch = "shared"
            pick = self._place_shared(request, fleet, under, others, tie_key, shared_slack)
        elif has_match:
            branch = "score"
            pick = self._best_score(fleet, others, queue_weight, tie_key)
        else:
            branch = "ring"
            pick = self._ring_pick(fleet, free, ring_key, queue_weight)
        picked = self._group_of(fleet, pick, groups)
        if branch != "ring":
            reason = "affinity" if picked.tokens == groups[0].tokens else "spill"
        elif best_any:
            reason = "spill"  # some of the prompt is cached, on replicas that could not take it
        elif settings.ring_slack is not None:
            # Nothing of the prompt is cached anywhere: the least busy replica is the intended
            # placement, not an overflow (no cache is lost), whichever the ring names for ties.
            reason = "ring"
        else:
            # pure CHWBL: the key's ring home is the placement; leaving it (over its bound) spills
            everyone = load.n == len(self._weights)
            home_pick = self.ring.owner(ring_key) if everyone else self._first_eligible(ring_key, load)
            reason = "ring" if pick == home_pick else "spill"

        # where the match stops at a text chunk, how far into the next one the prompt still
        # shares text held there (asked before this request's own record below)
        forked = precise.fork_tokens(pick, request, picked.depth) if precise is not None and picked.depth else 0
        added: list[int] = []
        started: Token | None = None
        if record:
            added = self._record(pick, request)
            if precise is not None:
                precise.chose(pick, request, load.pending[load.index[pick]])
            if start is not None:
                started = self.demand.record(start)
                if counts_returns:
                    self.returns.started(keys, request.flow)
        predicted = picked.tokens
        if precise is not None:
            # less where queued work there evicts some of it first; with no match, what its
            # engine holds below the match floor (still a hit)
            expected = precise.expected_depth(pick, request, picked.depth)
            predicted = depth_tokens(request, expected) if expected != picked.depth else max(predicted, forked)
            held = precise.held_tokens(pick, request)
            if held is not None:  # past the window, the engine's events bound what the records credit
                predicted = min(predicted, held)
        # An engine caches whole blocks only: a depth past the window (a text key's token
        # estimate) ends inside a block, whose tokens are computed again.
        predicted -= predicted % block_size
        prompt_tokens = request.prompt_tokens_estimate or request.prompt_tokens
        if prompt_tokens:
            # vLLM always recomputes a prompt's last token, so a full hit stops one block short.
            predicted = min(predicted, (prompt_tokens - 1) // block_size * block_size)
        # ... whole blocks of its own size: where the replica's engine uses larger blocks than
        # the route hashes (a fleet that disagrees on --block-size), fewer tokens than matched.
        engine_block = getattr(replicas[load.index[pick]], "block_size", None)
        if engine_block and engine_block > block_size and engine_block % block_size == 0:
            predicted -= predicted % engine_block
        worked = self.work.record(pick, (prompt_tokens or 0) - max(0, predicted)) if record else None
        detail: dict[str, Any] = {
            "predicted_cached_tokens": max(0, predicted),
            "matched_blocks": picked.depth,
            "best_matched_blocks": best_any,
            "key_source": key_source,
            "key_depth_blocks": key_depth,
            "blocks": len(keys),
            "block_size": block_size,
        }
        if precise is not None:
            detail["kv_mode"] = precise.mode_of(pick, block_size)[0]  # precise: matched from the engine's events
        if over_context:
            detail["over_context"] = True  # nothing recorded: observe and forget_attempt have nothing to mend
        if added:
            detail["recorded_keys"] = added  # taken back by forget_attempt if the attempt fails
        if started is not None:
            detail["started"] = started  # likewise
        if worked is not None:
            detail["work"] = worked  # likewise
        if record and keys:
            detail["withdrawals"] = self._withdrawals  # observe: did one happen while it ran?
        if not commit:
            # The explain-only part (hex key, per-candidate table over every replica) costs a
            # pass over the fleet, a ring walk and string formatting: real requests skip it.
            detail["branch"] = branch  # home | balance | shared | score | ring
            if head_view is not None:
                detail["shared_head"] = head_view  # a new conversation behind a shared head
            if kept_over_bound:
                detail["kept_over_bound"] = True  # its holders were over the bound; a spill would not pay
            detail["key"] = f"{ring_key:016x}"
            detail["load_factor"] = settings.load_factor
            # the queued prefill's weight in this request's scores: 0 where the candidates hold
            # different cached prefixes of it (see _queue_gap)
            detail["prefill_queue_weight"] = queue_weight
            detail["total_in_flight"] = load.total_in_flight
            detail["candidates"] = candidate_table(
                fleet, self.ring, ring_key, replicas, groups, free, has_match, queue_weight, settings.load_cost_tokens
            )
        return Decision(pick, reason, detail)

    def _record(self, pick: str, request: RequestView) -> list[int]:
        """Record ``request``'s keys on ``pick``; returns the keys it did not hold before."""
        blocks = (token_blocks(request), request.block_size or 1)
        tokens_at = partial(depth_tokens, request)
        return self.index.record(pick, request.block_keys, beyond_window(request), tokens_at, blocks)

    def observe(self, request: RequestView, decision: Decision, cached_tokens: int | None) -> None:
        """The index was updated when the request was placed; one case is left to mend.  Two
        requests with the same new prompt on one replica: the first added the keys, the
        second found them held and added none; the first was not served and took them back.
        The second, served, records them again — only when some attempt was taken back while
        it ran (an int compare per served request) and its prompt is no longer held."""
        keys, name = request.block_keys, decision.replica
        if decision.detail.get("over_context"):
            return  # recorded nothing (if its engine served it after all, its events say so)
        if self.precise is not None and keys:
            self.precise.finished(name, request)
        if decision.detail.get("withdrawals", self._withdrawals) == self._withdrawals or not keys:
            return
        if self.index.knows(name) and not self.index.holds(name, keys[-1]):  # known: not one that left
            self._record(name, request)

    def forget_attempt(self, request: RequestView, decision: Decision) -> None:
        """The replica did not serve the attempt (a 4xx, 5xx, transport failure, or a client
        gone before the first byte): take back what the decision newly recorded, so the prefix
        is not credited to a replica that never computed it — here and, through the index's
        sink, on the peers that heard of the record.  Keys the replica held before stay (the
        record reported only the keys it added).  The prefill work charged to the replica and
        the conversation start behind a shared head are undone too (the start only here: a
        peer that counted it keeps a decayed demand count, which says nothing of a replica)."""
        if decision.detail.get("over_context"):
            return  # recorded nothing: taking its keys back would take back other requests' records
        keys = decision.detail.get("recorded_keys")
        if keys:
            self.index.unrecord(decision.replica, keys)
            self._withdrawals += 1
        if self.precise is not None:
            self.precise.withdraw(decision.replica, request)
        started = decision.detail.get("started")
        if started is not None:
            self.demand.undo(started)
        worked = decision.detail.get("work")
        if worked is not None:
            self.work.undo(worked)

    def snapshot(self) -> dict[str, Any]:
        """State for ``/admin/stats``: ring membership and affinity-index occupancy."""
        return {
            "ring": {"members": self.ring.members, "virtual_nodes": self.settings.virtual_nodes},
            "affinity": {
                "keys": len(self.index),
                "entries": self.index.entries(),
                "capacity_per_replica": self.index.capacity(),
                "per_replica": {name: self.index.entries(name) for name in self._weights},
                # replica_cache_tokens: each modelled prefix cache's size and what it holds, in tokens
                "modelled_cache_tokens": {
                    name: {"capacity": capacity, "held": held}
                    for name, (capacity, held) in self.index.modelled_caches().items()
                },
            },
            "starts": self.demand.snapshot(),
            "start_returns": self.returns.snapshot(),
            "recent_prefill_work": self.work.snapshot(),
        }

    # -- helpers -----------------------------------------------------------------------
    def _groups(self, request: RequestView, found: list[tuple[int, int]]) -> list[Group]:
        """The index's groups with the prompt tokens each holds, most first, and their extra room.

        Keys cover the whole prompt (token blocks, then text chunks), so a conversation's
        previous turn is matched to its full length.  Only a prompt running past its keys
        (none continue past the window, e.g. a route whose window is not full) uses the old
        estimate: a replica matching *every* key is credited with the length of the prompt
        that last ended there (one group each).  Extra room (``bound_extra``) only where a
        long enough prefix is cached: a conversation keeps its replica at low load, a short
        popular prefix cannot pile up beyond the bound.
        """
        settings = self.settings
        keys = request.block_keys
        total = beyond_window(request) if settings.estimate_past_window else None
        groups: list[Group] = []
        for depth, mask in found:
            tokens = depth_tokens(request, depth)
            if total is None or depth != len(keys):
                groups.append(Group(depth, tokens, mask))
                continue
            while mask:
                low = mask & -mask
                mask ^= low
                extent = self.index.extent(self.index.name_of(low.bit_length() - 1), keys[-1])
                groups.append(Group(depth, max(tokens, min(extent, total)) if extent else tokens, low))
        groups.sort(key=lambda group: -group.tokens)
        deep = max(1, settings.bound_extra_min_tokens)
        if settings.bound_extra:
            for group in groups:
                if group.tokens >= deep:
                    group.extra = settings.bound_extra
        return groups

    def _group_of(self, fleet: DecisionFleet, name: str, groups: list[Group]) -> Group:
        bit = fleet.bits[fleet.load.index[name]]
        return next((group for group in groups if group.mask >> bit & 1), Group(0, 0, 0))

    def _home(self, keys: Sequence[int], fleet: DecisionFleet, under: list[Group]) -> str | None:
        """The under-bound replica with the deepest match among them, if that match is this
        request's own history (no other prompt went on differently after it: see
        :meth:`AffinityIndex.forks_at`) and no other under-bound replica holds as much (then
        moving would cost nothing: load may decide).  ``under``: groups, most held first."""
        best = [group for group in under if group.tokens == under[0].tokens]
        if any(self.index.forks_at(keys, group.depth) for group in best):
            return None
        homes: list[int] = []
        for group in best:
            homes += fleet.admitted_members(group, 2 - len(homes))
            if len(homes) > 1:
                return None
        return fleet.load.names[homes[0]] if homes else None

    def _least_worked(
        self, fleet: DecisionFleet, holders: list[Group], head_tokens: int, factor: float, tie_key: int
    ) -> str | None:
        """Where a new conversation behind a shared head starts for prefill-work balance.

        The limit is ``factor`` x the mean recent work per unit of weight, and at least the
        mean + the head's ``head_tokens``: a copy of the head is paid only for an imbalance
        larger than itself (a 10k-token head is not copied to even out a few short turns).
        While some holder is over it and every holder is busy: the least-worked admitted holder
        under the limit, else the admitted non-holder that did the least, provided it did less
        than every holder and has less prefill queued than the head (it computes the head and
        becomes a holder: only with room for it, see the module's "balance").  Ties by the
        request's own key.  None: start as usual (the score among the holders).

        Only a head on a few replicas is weighed (listing them is cheap, and copying a head
        that most of the fleet holds balances nothing); the pass over the fleet to find the
        least-worked replica runs only once the holders are over the limit.
        """
        load = fleet.load
        if load.n < 2 or self._weight_sum <= 0 or sum(group.size for group in holders) > LIST_AT_MOST:
            return None
        work, names, weights = self.work, load.names, load.weights
        mean = work.total() / self._weight_sum  # per unit of weight
        limit = max(factor * mean, mean + head_tokens / fleet.mean_weight)

        def per_weight(slot: int) -> float:
            w = weights[slot]
            return work.count(names[slot]) / w if w > 0 else math.inf

        held: dict[int, Group] = {}
        for group in holders:
            held.update((slot, group) for slot in fleet.members(group))
        over = len(held) < load.n and any(per_weight(slot) > limit for slot in held)
        if not over or any(map(fleet.idle_member, holders)):
            # (a head every replica holds: the load terms place its starts; an idle holder keeps
            # one-at-a-time traffic: nothing waits there)
            return None
        # Some holder is over the limit: the tenant's next start goes to its least-worked
        # holder if one is under it, else to the least-worked replica elsewhere.
        within = [(per_weight(slot), slot) for slot, group in held.items() if fleet.admitted(slot, group)]
        within = [(value, slot) for value, slot in within if value <= limit]
        if not within:
            nobody = Group(0, 0, 0)
            elsewhere = [
                (per_weight(s), s)
                for s in range(load.n)
                if s not in held and fleet.admitted(s, nobody) and fleet.has_room(s, head_tokens)
            ]
            floor = min(per_weight(slot) for slot in held)
            within = [(value, slot) for value, slot in elsewhere if value < floor]
            if not within:
                return None
        least = min(value for value, _ in within)
        tied = [names[slot] for value, slot in within if value <= least * (1 + 1e-9)]
        return tied[0] if len(tied) == 1 else self.ring.first(tie_key, tied)

    def _queue_gap(self, block_size: int, one_shot: bool) -> int:
        """How much more of the prompt (tokens) one candidate may hold than another while the
        queued prefill still counts in choosing between them: a block, or for a new request
        behind a shared head whose starts do not come back (``one_shot``: a RAG question, a
        batch job's request) ``one_shot_queue_gap_tokens``.

        Such a request's own time to first token is all its placement decides (no later turn
        follows it), and a short head costs little to compute again.  Measured on ``rag`` at
        moderate load: a 688-token preamble held by three replicas with ten requests and 30k
        prefill tokens queued each took every question while the fourth replica sat idle (its
        in-flight cost, 64 tokens a request, stayed under the 688 tokens held); TTFT p99 was
        1.4-1.5x the approximate model's, whose coarser match saw all four as equal."""
        short = self.settings.one_shot_queue_gap_tokens
        return max(block_size, short) if one_shot and short is not None else block_size

    def _copy_pays(self, head: int, prior: float, head_tokens: int) -> bool:
        """Whether copying ``head`` for prefill-work balance pays: a copy moves about half of the
        head's later work (its share of recent starts x the recent prefill work), which must
        be at least the head's own length."""
        return self.demand.share(head, prior) * self.work.total() >= 2 * head_tokens

    def _starts_commit(self, flow: str | None) -> bool:
        """Whether recent new conversations come back for later turns (``head_copy_min_returns``
        per start, see :mod:`gateway.routing.returns`; a named ``flow``'s own): then a start
        commits load for its whole conversation, which the head rules spread before it piles up."""
        least = self.settings.head_copy_min_returns
        return least is None or self.returns.rate(flow) >= least

    def _copy_saves_wait(
        self, fleet: DecisionFleet, holders: list[Group], head_tokens: int, own_queued: Callable[[int], int]
    ) -> bool:
        """Whether computing the head elsewhere is quicker than waiting on its holders, by more
        than ``spill_min_saving`` x the head it computes again (a copy is a spill, and pays as
        one does): every admitted holder has more prefill queued than the least-queued replica
        plus the head, plus that margin (per unit of weight).  What a copy for a start that
        commits nothing must buy.  Measured on ``tenants`` (samples 3-6, quick): without the
        margin a batch job's second request, 0.01 s after its first, copied the 4-5k-token
        document to the three idle replicas to save ~300 tokens of wait (the first request's
        tail); the chat tenant's turns then queued behind the copies (up to -2.1 hit points
        against ``sglang_like`` and 1.3x its TTFT p90).

        The requesting flow's own work on a holder (``own_queued``, tokens per slot) does not
        count unless ``head_copy_own_flow_wait``: a batch job's forty requests behind one
        document queue on its holder, and a copy "saving" the job's wait behind its own burst
        recomputes the document on the least-queued replica, where the other tenants' requests
        go next (measured on ``tenants``: 3 recomputed documents a job, and the chat tenant's
        turns queued behind them)."""
        least = fleet.least_queued()
        if least is None:
            return False
        admitted = [slot for group in holders for slot in fleet.members(group) if fleet.admitted(slot, group)]
        copy_wait = least + head_tokens * (1.0 + (self.settings.spill_min_saving or 0.0))
        # no holder may take it (all over their load bound): it goes elsewhere anyway, a spill, and
        # explain must not call that a copy that saves the wait
        return bool(admitted) and all(fleet.queued(slot, 1.0, less=own_queued(slot)) > copy_wait for slot in admitted)

    def _own_queued(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Callable[[int], int]:
        """The requesting flow's own prefill queued on each slot, in tokens; 0 for an anonymous
        request, with ``head_copy_own_flow_wait``, or unless another flow sent a recent request
        on this route (:mod:`gateway.routing.flows`: alone, a copy runs in front of nobody
        else's).  Slots are ``replicas``' positions, as the load's (the runner builds both from
        one list)."""
        flow = request.flow
        if flow is None or self.settings.head_copy_own_flow_wait or not self.flows.others_within(flow):
            return _nothing_own
        return lambda slot: replicas[slot].pending_prefill_by_flow.get(flow, 0)

    def _keep_over_bound(
        self,
        request: RequestView,
        fleet: DecisionFleet,
        deepest: Group,
        under: list[Group],
        free: Group | None,
        own: Callable[[int], int],
    ) -> bool:
        """Whether the replicas holding the most of the prompt, all over their load bound, keep
        the request anyway (then ``deepest.kept`` admits the one with the shortest wait).

        A spill recomputes the prompt the holder has cached on a replica holding less of it.
        That is paid only when it shortens the request's estimated wait
        (:meth:`DecisionFleet.wait`: in-flight requests, so a pile of cached requests still
        counts for its decode batch, queued prefill and its own uncached prompt) by more than
        ``spill_min_saving`` x the tokens computed again.  A batch job's burst behind one long
        document is mostly cached requests queued behind the document itself, and a spill
        computes the document a second time while the first is still queued (measured on
        ``tenants``: a recomputed document per job, the job's TTFT p90 1.1x).  Never past twice
        the bound (with its extra room; on a small fleet at load_factor 2 the in-flight term
        comes first).  Only a listed (small) group is weighed.

        ``own`` (:meth:`_own_queued`): the requesting flow's own queued prefill, which does not
        count, as for the copy-saves-wait rule: a spill is a copy too, and a job jumping its own
        burst's queue recomputes the document where the other tenants' requests go next
        (measured on ``tenants`` at 128-token blocks: the wait behind the job's 35 queued
        requests bought a copy by a hair, -0.5 points against ``sglang_like``)."""
        settings = self.settings
        if deepest.tokens < max(1, settings.bound_extra_min_tokens) or not fleet.small(deepest):
            return False  # a short popular prefix is spread (as for bound_extra)
        prompt = request.prompt_tokens_estimate or request.prompt_tokens or deepest.tokens
        per_request = settings.load_cost_tokens
        wait = partial(fleet.wait, prompt=prompt, per_request=per_request, own=own)
        load = fleet.load
        best_slot: int | None = None
        best_wait = math.inf
        for slot in fleet.members(deepest):
            here = wait(slot, deepest.tokens)
            if load.in_flight[slot] < 2 * (fleet.bound(slot) + deepest.extra) and here < best_wait:
                best_slot, best_wait = slot, here
        if best_slot is None:
            return False
        order = load.order(per_request, 1.0)
        saving_per_token = settings.spill_min_saving or 0.0
        for group in [*under, *([free] if free is not None else [])]:
            cheapest = fleet.cheapest(group, order, partial(wait, held=group.tokens))
            if cheapest is not None and best_wait - cheapest.cost > saving_per_token * (deepest.tokens - group.tokens):
                return False  # spilling there saves more wait than it recomputes
        deepest.kept = load.in_flight[best_slot] + 1 - fleet.bound(best_slot) - deepest.extra
        return True

    def _first_eligible(self, key: int, load: FleetLoad) -> str:
        """The first eligible replica in ring order from ``key`` (a short walk: most are)."""
        pick = self.ring.first_where(key, load.index.__contains__, 64 + 8 * len(self.ring) // load.n)
        if pick is None:
            pick = self.ring.first(key, load.names)
        assert pick is not None  # the runner's replicas are always admitted to the ring
        return pick

    def _ring_pick(self, fleet: DecisionFleet, free: Group, ring_key: int, queue_weight: float) -> str:
        """No under-bound replica holds any of the request: the first in ring order from its
        key among the free replicas whose load is at most the least + ``ring_slack``."""
        # in requests: queued tokens count load_cost_tokens per request (with load_cost_tokens
        # 0, any queued prefill outweighs request counts, which still break its ties)
        per_request = max(self.settings.load_cost_tokens, 1.0)

        def cost(slot: int) -> float:
            return fleet.busy(slot) + fleet.queued(slot, queue_weight) / per_request

        order = fleet.load.order(1.0, queue_weight / per_request)
        best = fleet.cheapest(free, order, cost)
        assert best is not None  # some replica is free when none under its bound has a match
        per_key = fleet.per_key(1.0, queue_weight / per_request)
        return fleet.first_in_ring(
            self.ring, ring_key, [fleet.tie(free, order, cost, best, self.settings.ring_slack, per_key)]
        )

    def _best_score(self, fleet: DecisionFleet, groups: list[Group], queue_weight: float, tie_key: int) -> str:
        """The under-bound replica with the best ``cached - load_cost_tokens x load - queued``;
        ties by the request's own key.  ``groups``: those with a replica under its bound."""
        lc = self.settings.load_cost_tokens
        order = fleet.load.order(lc, queue_weight)
        best: list[tuple[Group, Cost, Cheapest]] = []
        for group in groups:

            def cost(slot: int, held: int = group.tokens) -> float:  # the score, negated
                return -(held - lc * fleet.busy(slot) - fleet.queued(slot, queue_weight))

            cheapest = fleet.cheapest(group, order, cost)
            if cheapest is not None:
                best.append((group, cost, cheapest))
        top = min(cheapest.cost for _, _, cheapest in best)
        ties = [fleet.tie(group, order, cost, cheapest) for group, cost, cheapest in best if cheapest.cost == top]
        return fleet.first_in_ring(self.ring, tie_key, ties)

    def _place_shared(
        self,
        request: RequestView,
        fleet: DecisionFleet,
        under: list[Group],
        groups: list[Group],
        tie_key: int,
        slack: float,
    ) -> str:
        """Where a request that shares only a prefix goes: replicate a busy prefix, don't pile on it.

        Each under-bound replica's cost estimates this request's time to first token in
        tokens of prefill: the prefill queued there, plus this request's own uncached prompt
        there (the whole prompt less what it holds; x ``shared_recompute_weight``: a new
        conversation's later turns reuse the head, so computing it is paid once for several
        turns), plus ``load_cost_tokens`` per request in flight (per unit of weight).  A
        replica without the shared head pays for computing it, so the holder keeps new
        requests until its queue costs more than that — then the
        cheapest replica takes the request and computes the head, which it holds from then on:
        a hot prefix ends up on as many replicas as its traffic needs, a quiet one on one.
        The best holder also keeps the request while within ``slack`` requests' worth
        (x ``load_cost_tokens``) of the cheapest.  Ties break on the request's own key (most
        of the prompt held first): a tenant's new conversations spread.  ``under``: the
        groups holding some of the prompt with a replica under its bound; ``groups``: those
        and the free one if it has such a replica.
        """
        settings = self.settings
        per_request = settings.load_cost_tokens
        queue_weight = settings.prefill_queue_weight
        block = request.block_size or 1
        total = request.prompt_tokens_estimate or request.prompt_tokens or 0
        recompute = settings.shared_recompute_weight
        order = fleet.load.order(per_request, queue_weight)
        wait = partial(
            fleet.wait, prompt=total, per_request=per_request, queue_weight=queue_weight, recompute=recompute
        )
        best: list[tuple[Group, Cost, Cheapest]] = []
        for group in groups:
            cost = partial(wait, held=group.tokens)
            cheapest = fleet.cheapest(group, order, cost)
            if cheapest is not None:
                best.append((group, cost, cheapest))
        least = min(cheapest.cost for _, _, cheapest in best)
        most = under[0].tokens
        holders = [entry for entry in best if entry[0].tokens > most - block]
        holder_cost = min(cheapest.cost for _, _, cheapest in holders)
        if holder_cost <= least + slack * max(per_request, 1.0):
            pool = [entry for entry in holders if entry[2].cost == holder_cost]
        else:
            pool = [entry for entry in best if entry[2].cost == least]
            top = max(group.tokens for group, _, _ in pool)  # among the cheapest, most of the prompt held
            pool = [entry for entry in pool if entry[0].tokens == top]
        ties = [fleet.tie(group, order, cost, cheapest) for group, cost, cheapest in pool]
        return fleet.first_in_ring(self.ring, tie_key, ties)

    def _sync_block_size(self, block_size: int) -> None:
        """Set what follows the route's block size once it is known (and when the engines'
        changes it): the index's stride, a fixed span of tokens, so that 128-token blocks are
        not matched at 512-token resolution (a simulated engine at vLLM's CPU 128 held 30 blocks of a
        document, the model matched 28: each prediction two blocks short until its events came), and
        a stored key's standard weight in a modelled cache, one stride of blocks unless its
        record says otherwise (a peer's record cannot)."""
        if block_size != self._weights_block_size:
            self._weights_block_size = block_size
            self.index.set_stride(self.settings.stride_for(block_size))
            self.index.default_weight = block_size * self.index.stride
