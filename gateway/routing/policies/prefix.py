"""The ``prefix`` policy: send a request where its prefix is cached, without hot spots.

Inputs are the request's chained keys (the whole prompt, see :mod:`gateway.prefix`), its
whole prompt length (estimated past the window), and each eligible replica's in-flight count
and queued prefill (uncached prompt tokens of requests sent there that have no first byte
yet, counted by the gateway).  Cached and queued work are compared in one unit, tokens: a
new request's time to first token is roughly the prefill queued ahead of it plus its own
uncached tokens.  The decision, in order:

1. **Load bound (CHWBL).**  Replica *r* may take the request only while
   ``in_flight_r < ceil(c x (total_in_flight + 1) x w_r / W)`` (c = ``load_factor``), plus
   ``bound_extra`` (2) if *r* holds at least ``bound_extra_min_tokens`` (2,048) of this prompt:
   the textbook bound pushes a long conversation off its replica at low load (two other
   requests there are enough), recomputing thousands of tokens to save a short wait, while
   short popular prefixes must not pile up.  Some replica is always under its bound, so the
   bound is never exceeded.
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
     needs (``head_load_factor``, :mod:`gateway.routing.starts`).  While it has fewer and
     every holder is busy, the request starts on another replica (the ring branch: least
     busy), which computes the head; else the score below (the head's holders win).
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
   processes agree on without sharing state.  Reason ``ring`` (the key's home) or ``spill``.
4. **Fallback.**  No keys at all (prompt shorter than one block, embeddings): least loaded.

Every choice is recorded in the affinity index *at decision time* (a burst of requests with a
new shared prefix follows the first one instead of scattering) and taken back if the attempt
fails before the replica answers (``forget_attempt``), and every tie is broken by
the ring order of the request's own key — its session header, else its deepest key, never a
shared head's key and never list position — so gateway processes with the same membership
and state choose the same replica, and conversations behind one head spread.

``Decision.detail`` carries ``predicted_cached_tokens`` and everything ``/admin/explain``
shows.  No HTTP, metrics or logging here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import xxhash
from pydantic import Field

from gateway.routing.affinity import AffinityIndex
from gateway.routing.base import Decision, PolicySettings, ReplicaView, RequestView
from gateway.routing.policies.least_loaded import least_loaded
from gateway.routing.ring import HashRing, load_bounds
from gateway.routing.starts import HeadDemand

REASONS = ("affinity", "ring", "spill", "fallback")


class PrefixPolicySettings(PolicySettings):
    """Settings of the ``prefix`` policy (all optional)."""

    load_factor: float = Field(
        2.0, ge=1.0, le=100.0, description="CHWBL bound c: in-flight must stay below ceil(c x mean load)"
    )
    key_depth_tokens: int = Field(
        256, ge=1, description="ring key = chain key of the block at this depth (or the deepest full block)"
    )
    virtual_nodes: int = Field(160, ge=1, le=10_000, description="ring points per replica per unit of weight")
    affinity_max_bytes: int = Field(
        64 * 1024 * 1024,
        ge=4096,
        description="memory bound of the affinity index in bytes, shared by the replicas (LRU eviction per "
        "replica; about 400 bytes per stored (key, replica) pair: 64 MiB hold ~170,000 pairs, ~1,700 "
        "32k-token prompts at the default stride)",
    )
    affinity_max_entries: int | None = Field(
        None, ge=1, description="optional extra bound: (prefix key, replica) pairs in the affinity index"
    )
    affinity_stride_blocks: int = Field(
        4, ge=1, description="index every n-th block key (and the deepest): memory / n, match depth granularity x n"
    )
    replica_cache_tokens: int | None = Field(
        None,
        ge=1,
        description="model each replica's prefix cache as an LRU of this many (window) tokens, e.g. "
        "num_gpu_blocks x block_size; default: bounded by affinity_max_bytes only",
    )
    load_cost_tokens: float = Field(
        64.0,
        ge=0.0,
        description="affinity score: one more in-flight request (per unit of weight) costs as much as "
        "this many uncached prompt tokens",
    )
    prefill_queue_weight: float = Field(
        1.0,
        ge=0.0,
        description="among replicas holding the same cached prefix of the request, each uncached prompt token "
        "queued on one (sent, no first byte yet; per unit of weight) counts like this many tokens of work: "
        "1 = the shortest estimated time to first token, 0 = in-flight counts only",
    )
    ring_slack: int | None = Field(
        0,
        ge=0,
        description="no affinity: the ring's choice may be this many in-flight requests (x load_cost_tokens, "
        "queued prefill included) busier than the least busy replica (0: least busy, ties by ring order; "
        "null: pure CHWBL, only the load bound)",
    )
    bound_extra: int = Field(
        2,
        ge=0,
        description="in-flight requests a replica may hold above its CHWBL bound when it has at least "
        "bound_extra_min_tokens of this prompt cached (0: the textbook bound everywhere)",
    )
    bound_extra_min_tokens: int = Field(
        2048,
        ge=0,
        description="matched (cached) prompt tokens a replica needs to get bound_extra: long histories stay "
        "home at low load, short popular prefixes cannot pile up",
    )
    estimate_past_window: bool = Field(
        True,
        description="a prompt running past its keys (they stop at the window when no text continues them): a "
        "replica matching every key is credited with the length of the prompt that last ended there",
    )
    sticky_homes: bool = Field(
        True,
        description="a request whose deepest match is its own history (on one replica, and no other prompt went "
        "on differently from there: a conversation's next turn) stays on that replica while it is under its load "
        "bound; off: scored like any other request (load_cost_tokens may move it to a replica holding less of it)",
    )
    shared_prefix_slack: float | None = Field(
        None,
        ge=0.0,
        description="a request whose deepest match is a prefix other prompts went on from differently (a new "
        "conversation behind a tenant's system prompt) goes where its estimated time to "
        "first token is least (queued prefill + its own uncached prompt + load_cost_tokens per request in "
        "flight): a busy holder's queue makes another replica compute the head too (replicate, don't "
        "hot-spot). The best holder keeps it within this many requests (x load_cost_tokens) of the cheapest. "
        "null: such requests are scored like any other",
    )
    shared_recompute_weight: float = Field(
        0.0,
        ge=0.0,
        description="placing a request that shares only a prefix: its uncached prompt tokens on a replica count "
        "this much against queued prefill and in-flight requests (0: the least busy replica, by in-flight "
        "and queued prefill; 1: this request's time to first token alone, so a holder keeps new conversations "
        "until its queue outweighs computing the head elsewhere)",
    )
    head_load_factor: float | None = Field(
        1.0,
        ge=0.25,
        le=100.0,
        description="a shared head (a prefix other prompts went on from differently: a tenant's system prompt) gets "
        "as many holders as its share of recent new conversations, in replicas: round(share x replicas / this), at "
        "least 1; while it has fewer and every holder is busy, a new conversation behind it starts on another "
        "replica, which computes the head. Larger: fewer copies. null: new conversations always prefer the head's "
        "holders (up to the load bound)",
    )
    head_window_starts: int = Field(
        256, ge=1, description="recent starts: a start weighs 1/e after this many more in the pool"
    )
    head_min_starts: int | None = Field(
        None,
        ge=1,
        description="a head's share is taken over at least this many recent starts (default: 2 x replicas), so a "
        "fresh pool does not copy heads on its first few requests",
    )
    use_session_key: bool = Field(True, description="use the route's session header value as the ring key if present")


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
            settings.affinity_stride_blocks,
            None,  # set per block size on first use (the capacity is in blocks)
            max_bytes=settings.affinity_max_bytes,
        )
        self._capacity_block_size = 0
        self.demand = HeadDemand(settings.head_window_starts)
        self._turn = 0
        self.set_members(members)

    # -- membership --------------------------------------------------------------------
    def set_members(self, members: Sequence[ReplicaView]) -> None:
        """Rebuild the ring only when names or weights changed; forget replicas that left."""
        weights = {m.name: float(m.weight) for m in members}
        if weights != self._weights:
            self._weights = weights
            self.ring = HashRing(weights, self.settings.virtual_nodes)
        self.index.set_members(weights)

    def _admit(self, replicas: Sequence[ReplicaView]) -> None:
        """A replica the runner offers but ``set_members`` never named joins the ring."""
        missing = {r.name: float(r.weight) for r in replicas if r.name not in self._weights}
        if missing:
            weights = {**self._weights, **missing}
            self._weights = weights
            self.ring = HashRing(weights, self.settings.virtual_nodes)
            self.index.set_members(weights)

    # -- the decision ------------------------------------------------------------------
    def choose(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        """Decide and record the placement in the affinity index."""
        return self._decide(request, replicas, commit=True)

    def peek(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        """What :meth:`choose` would decide now, changing nothing (``/admin/explain``).

        The affinity index is not touched and the fallback tie-break turn does not advance,
        so the next real request is placed exactly as if the peek had never happened.  (A
        replica the runner offers that was never named still joins the ring: membership,
        which ``choose`` would sync the same way, not per-request state.)
        """
        return self._decide(request, replicas, commit=False)

    def _decide(self, request: RequestView, replicas: Sequence[ReplicaView], commit: bool) -> Decision:
        self._admit(replicas)
        settings = self.settings
        keys = request.block_keys
        block_size = request.block_size or 1
        ring_key, key_source, key_depth = self._ring_key(request)
        if ring_key is None:
            turn = self._turn + 1
            if commit:
                self._turn = turn
            pick = least_loaded(replicas, turn)
            return Decision(pick.name, "fallback", {"predicted_cached_tokens": 0, "key_source": "none"})
        self._sync_capacity(block_size)

        # One pass over the replicas (this runs for every replica on every request).
        in_flight: dict[str, int] = {}
        weights: dict[str, float] = {}
        pending: dict[str, int] = {}  # only replicas with queued prefill
        total = 0
        for r in replicas:
            name = r.name
            f = in_flight[name] = r.in_flight
            total += f
            weights[name] = float(r.weight)
            p = r.pending_prefill_tokens
            if p:
                pending[name] = p
        first_weight = weights[replicas[0].name]
        uniform = first_weight > 0 and all(w == first_weight for w in weights.values())
        if uniform:  # equal weights (the usual case): one bound for all, ceil(c x (total + 1) / n)
            bound = math.ceil(round(settings.load_factor * (total + 1) / len(in_flight), 9))
            bounds = dict.fromkeys(in_flight, bound)
        else:
            bounds = load_bounds(in_flight, weights, settings.load_factor)
        # every member eligible (the usual case): the index matches against all of them
        everyone = len(in_flight) == len(self._weights)
        depth = self.index.match(keys, None if everyone else in_flight) if keys else {}
        best_any = max(depth.values(), default=0)
        matched = self._matched_tokens(request, depth)
        if settings.bound_extra:
            # Extra room only where a long enough prefix is cached: a conversation keeps its
            # replica at low load, a short popular prefix cannot pile up beyond the bound.
            deep = max(1, settings.bound_extra_min_tokens)
            for name, tokens in matched.items():
                if tokens >= deep and name in bounds:
                    bounds[name] += settings.bound_extra
        mean_weight = sum(weights.values()) / len(weights) or 1.0
        # In-flight per unit of weight; a weight-0 replica looks very busy (finite, so scores stay numbers).
        load: dict[str, float] = (
            in_flight  # type: ignore[assignment]  # read-only here: in-flight per unit of weight
            if uniform
            else {
                name: f * mean_weight / w if w > 0 else 1e9 + f
                for (name, f), w in zip(in_flight.items(), weights.values(), strict=True)
            }
        )
        under = [name for name, f in in_flight.items() if f < bounds[name]]
        if not under:  # impossible with load_factor >= 1; stay total anyway
            under = [r.name for r in replicas]
        has_match = any(depth.get(name, 0) for name in under)
        homes = self._homes(keys, depth, under, matched) if has_match and settings.sticky_homes else []
        # A new conversation behind a shared head (its deepest match is a fork) stays where it
        # starts: the head gets as many holders as its share of recent starts needs (see
        # gateway.routing.starts); while it has fewer and every holder is busy, start elsewhere.
        factor = settings.head_load_factor
        start: int | None = None  # the shared head behind a new conversation
        if factor is not None and not homes and best_any and self.index.is_fork(keys[best_any - 1]):
            start = keys[best_any - 1]
            holders = {name for name, d in depth.items() if d >= best_any}
            prior = settings.head_min_starts or 2 * len(in_flight)
            if len(holders) < self.demand.holders_needed(start, len(in_flight), factor, prior) and all(
                in_flight[name] for name in under if name in holders
            ):
                others = [name for name in under if name not in holders]
                if others:
                    under = others
                    has_match = any(depth.get(name, 0) for name in under)
        # Ties break on this request's own identity — its session, or its deepest key (which
        # covers the whole prompt) — never on a shared head's key: conversations behind one
        # long system prompt spread instead of following that prompt's key to one replica.
        tie_key = ring_key if key_source == "session" else keys[-1]

        # The prefill already waiting on each replica (tokens per unit of weight), as a cost in
        # cached tokens — but only while the replicas that may take the request hold the same
        # cached prefix of it (within a block): queued work picks the shortest wait among
        # equally good caches and never pulls a request away from more of its prompt, which
        # the fleet would recompute (measured: that trade loses more hits than it saves time).
        queue_weight = settings.prefill_queue_weight
        cached_under = [matched.get(name, 0) for name in under]
        if queue_weight and max(cached_under) - min(cached_under) >= block_size:
            queue_weight = 0.0
        queued = dict.fromkeys(in_flight, 0.0)
        if queue_weight:
            for name, p in pending.items():
                w = weights[name]
                queued[name] = queue_weight * p * mean_weight / w if w > 0 else 0.0
        scores: dict[str, float] = {}
        shared_slack = settings.shared_prefix_slack
        if homes:
            # A conversation's next turn: its history ends on these replicas (under their
            # bound).  Stay: the bound, not a score, guards against hot spots.
            branch = "home"
            pick = homes[0]
            reason = "affinity" if matched.get(pick, 0) == max(matched.values()) else "spill"
        elif has_match and shared_slack is not None and self._shared_only(keys, depth):
            branch = "shared"
            pick = self._place_shared(
                request, weights, pending, under, load, matched, tie_key, shared_slack, mean_weight
            )
            reason = "affinity" if matched.get(pick, 0) == max(matched.values()) else "spill"
        elif has_match:
            branch = "score"
            for name in under:
                scores[name] = matched.get(name, 0) - settings.load_cost_tokens * load[name] - queued[name]
            top = max(scores.values())
            tied = [name for name in under if scores[name] == top]
            pick = tied[0] if len(tied) == 1 else self._first(tie_key, tied)
            reason = "affinity" if matched.get(pick, 0) == max(matched.values()) else "spill"
        else:
            branch = "ring"
            home = self.ring.owner(ring_key) if everyone else self._first(ring_key, in_flight)
            slack = settings.ring_slack
            # in requests: queued tokens count load_cost_tokens per request (with load_cost_tokens
            # 0, any queued prefill outweighs request counts, which still break its ties)
            per_request = max(settings.load_cost_tokens, 1.0)
            cost = {name: load[name] + queued[name] / per_request for name in under}
            limit = float("inf") if slack is None else min(cost.values()) + slack
            pick = self._first(ring_key, [name for name in under if cost[name] <= limit])
            reason = "ring" if pick == home and best_any == 0 else "spill"

        predicted = matched.get(pick, 0)
        prompt_tokens = request.prompt_tokens_estimate or request.prompt_tokens
        if prompt_tokens:
            # vLLM always recomputes a prompt's last token, so a full hit stops one block short.
            predicted = min(predicted, (prompt_tokens - 1) // block_size * block_size)
        added: list[int] = []
        started: tuple[int, float, int] | None = None
        if commit:
            added = self.index.record(pick, keys, self._beyond_window(request))
            if start is not None:
                started = self.demand.record(start)
        detail: dict[str, Any] = {
            "predicted_cached_tokens": max(0, predicted),
            "matched_blocks": depth.get(pick, 0),
            "best_matched_blocks": best_any,
            "key_source": key_source,
            "key_depth_blocks": key_depth,
            "blocks": len(keys),
            "block_size": block_size,
        }
        if not commit and has_match and not scores:  # explain shows the generic scores on every branch
            scores = {
                name: matched.get(name, 0) - settings.load_cost_tokens * load[name] - queued[name] for name in under
            }
        if added:
            detail["recorded_keys"] = added  # taken back by forget_attempt if the attempt fails
        if started is not None:
            detail["started"] = started  # likewise
        if not commit:
            detail["branch"] = branch  # home | shared | score | ring
            # The explain-only part (hex key, per-candidate table) costs a ring walk and string
            # formatting: real requests only need the cheap fields above.
            detail["key"] = f"{ring_key:016x}"
            detail["load_factor"] = settings.load_factor
            detail["total_in_flight"] = sum(in_flight.values())
            detail["candidates"] = self._candidates(ring_key, replicas, bounds, depth, matched, scores)
        return Decision(pick, reason, detail)

    def observe(self, request: RequestView, decision: Decision, cached_tokens: int | None) -> None:
        """Nothing to learn: the index was updated when the request was placed."""
        return None

    def forget_attempt(self, request: RequestView, decision: Decision) -> None:
        """The attempt failed before the replica served anything (refused, reset, 5xx): take
        back what the decision newly recorded, so a retried request's prefix is not credited to
        the replica that failed it.  Keys the replica held before stay."""
        keys = decision.detail.get("recorded_keys")
        if keys:
            self.index.unrecord(decision.replica, keys)
        started = decision.detail.get("started")
        if started is not None:
            self.demand.undo(started)

    def snapshot(self) -> dict[str, Any]:
        """State for ``/admin/stats``: ring membership and affinity-index occupancy."""
        return {
            "ring": {"members": self.ring.members, "virtual_nodes": self.settings.virtual_nodes},
            "affinity": {
                "keys": len(self.index),
                "entries": self.index.entries(),
                "capacity_per_replica": self.index.capacity(),
                "per_replica": {name: self.index.entries(name) for name in self._weights},
            },
            "starts": self.demand.snapshot(),
        }

    # -- helpers -----------------------------------------------------------------------
    def _homes(
        self, keys: Sequence[int], depth: dict[str, int], under: list[str], matched: dict[str, int]
    ) -> list[str]:
        """Under-bound replicas with the deepest match among them, if that match is this
        request's own history (no other prompt went on differently after it: see
        :meth:`AffinityIndex.is_fork`) and no other under-bound replica holds as much (then
        moving would cost nothing: load may decide)."""
        best = max(matched.get(name, 0) for name in under)
        is_fork = self.index.is_fork
        homes: list[str] = []
        for name in under:
            if matched.get(name, 0) != best:
                continue
            d = depth.get(name, 0)
            if not d or is_fork(keys[d - 1]):
                return []
            homes.append(name)
        return homes if len(homes) == 1 else []

    def _first(self, key: int, names: Sequence[str] | dict[str, int]) -> str:
        """The first of ``names`` (never empty, all on the ring) in ring order from ``key``."""
        pick = self.ring.first(key, names)
        assert pick is not None  # the runner's replicas are always admitted to the ring
        return pick

    def _shared_only(self, keys: Sequence[int], depth: dict[str, int]) -> bool:
        """True when the deepest match is a prefix other prompts went on from differently.

        Then the request shares a prefix *inside* other prompts (a tenant's system prompt, a
        document many ask about) and continues none of them, so it may start on any replica —
        unlike a conversation's next turn, which continues its own history (on one replica;
        a relocated values block or an edit at the end does not change that).
        """
        best = max(depth.values())
        return self.index.is_fork(keys[best - 1])

    def _place_shared(
        self,
        request: RequestView,
        weights: dict[str, float],
        pending: dict[str, int],
        under: list[str],
        load: dict[str, float],
        matched: dict[str, int],
        tie_key: int,
        slack: float,
        mean_weight: float,
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
        of the prompt held first): a tenant's new conversations spread.
        """
        settings = self.settings
        per_request = settings.load_cost_tokens
        queue_weight = settings.prefill_queue_weight
        block = request.block_size or 1
        total = request.prompt_tokens_estimate or request.prompt_tokens or 0
        recompute = settings.shared_recompute_weight
        cost: dict[str, float] = {}
        for name in under:
            p = pending.get(name, 0)
            w = weights[name]
            queued = queue_weight * p * mean_weight / w if p and w > 0 else 0.0
            cost[name] = per_request * load[name] + queued + recompute * max(0, total - matched.get(name, 0))
        least = min(cost.values())
        best = max(matched.get(name, 0) for name in under)
        holders = [name for name in under if matched.get(name, 0) > best - block]
        holder_cost = min(cost[name] for name in holders)
        if holder_cost <= least + slack * max(per_request, 1.0):
            pool = [name for name in holders if cost[name] == holder_cost]
        else:
            pool = [name for name in under if cost[name] == least]
            top = max(matched.get(name, 0) for name in pool)
            pool = [name for name in pool if matched.get(name, 0) == top]
        return pool[0] if len(pool) == 1 else self._first(tie_key, pool)

    @staticmethod
    def _depth_tokens(request: RequestView, depth: int) -> int:
        """Prompt tokens covered by the request's first ``depth`` keys.

        Token blocks count ``block_size`` each; keys past them (the chain continued over
        the prompt's text) carry their own estimate in ``request.key_tokens``.
        """
        block_size = request.block_size or 1
        token_blocks = len(request.block_keys) if request.token_blocks is None else request.token_blocks
        if depth <= token_blocks:
            return depth * block_size
        extra = request.key_tokens
        i = depth - token_blocks - 1
        return extra[i] if i < len(extra) else depth * block_size

    def _beyond_window(self, request: RequestView) -> int | None:
        """The whole prompt's length when it runs past what the keys cover, else None."""
        total = request.prompt_tokens_estimate
        if not total:
            return None
        keyed = self._depth_tokens(request, len(request.block_keys))
        return total if total > keyed + (request.block_size or 1) else None

    def _matched_tokens(self, request: RequestView, depth: dict[str, int]) -> dict[str, int]:
        """Cached tokens per replica: what its matched keys cover, and past the keys an estimate.

        Keys cover the whole prompt (token blocks, then text chunks), so a conversation's
        previous turn is matched to its full length.  Only a prompt running past its keys
        (none continue past the window, e.g. a route whose window is not full) uses the old
        estimate: a replica matching *every* key is credited with the length of the prompt
        that last ended there.
        """
        keys = request.block_keys
        matched = {name: self._depth_tokens(request, d) for name, d in depth.items()}
        total = self._beyond_window(request)
        if total is None or not self.settings.estimate_past_window:
            return matched
        full = len(keys)
        for name, d in depth.items():
            if d == full:
                extent = self.index.extent(name, keys[-1])
                if extent:
                    matched[name] = max(matched[name], min(extent, total))
        return matched

    def _ring_key(self, request: RequestView) -> tuple[int | None, str, int]:
        keys = request.block_keys
        if self.settings.use_session_key and request.session_key:
            return xxhash.xxh3_64_intdigest(request.session_key.encode()), "session", 0
        if keys:
            depth = max(1, min(len(keys), self.settings.key_depth_tokens // (request.block_size or 1)))
            return keys[depth - 1], "block", depth
        return None, "none", 0

    def _sync_capacity(self, block_size: int) -> None:
        """Translate ``replica_cache_tokens`` into index entries once the block size is known."""
        tokens = self.settings.replica_cache_tokens
        if tokens is None or block_size == self._capacity_block_size:
            return
        self._capacity_block_size = block_size
        self.index.replica_capacity = max(1, tokens // (block_size * self.settings.affinity_stride_blocks))
        self.index.set_members(self._weights)

    def _candidates(
        self,
        ring_key: int,
        replicas: Sequence[ReplicaView],
        bounds: dict[str, int],
        depth: dict[str, int],
        matched: dict[str, int],
        scores: dict[str, float],
    ) -> list[dict[str, Any]]:
        by_name = {r.name: r for r in replicas}
        out = []
        for rank, name in enumerate(self.ring.walk(ring_key, by_name)):
            r = by_name[name]
            entry: dict[str, Any] = {
                "replica": name,
                "ring_rank": rank,
                "weight": r.weight,
                "in_flight": r.in_flight,
                "pending_prefill_tokens": r.pending_prefill_tokens,
                "bound": bounds[name],
                "under_bound": r.in_flight < bounds[name],
                "matched_blocks": depth.get(name, 0),
                "matched_tokens": matched.get(name, 0),
            }
            if name in scores:
                entry["score"] = scores[name]
            out.append(entry)
        return out
