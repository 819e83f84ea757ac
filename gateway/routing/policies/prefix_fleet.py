"""The prefix policy's view of the eligible replicas for one decision, without a pass over them.

The affinity index answers by *group*: the replicas whose deepest match of the request is
at the same depth (a mask of them, :meth:`AffinityIndex.match_groups`), deepest first; every
other eligible replica is in the *free* group (none of the prompt held).  Within a group all
replicas hold the same cached tokens, so the policy's costs differ only by load, and the
group's best replica is its least busy one under its bound.  :class:`DecisionFleet` finds it
without reading every member: a small group is listed; a large one (a hot head on most of
the fleet, or the free replicas) is met by walking the load's sorted cost order, where one
of its members comes every ~n / size entries.  Ties go to the first in ring order from the
request's key (:meth:`DecisionFleet.first_in_ring`), listed or found by a ring walk.

Bounds come from the load's sums (:class:`~gateway.routing.ring.LoadBound`, one per weight),
busyness and queued prefill per unit of weight from the same float formulas a whole-fleet
pass would use; costs are compared exactly, the orders only decide which replicas to read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.routing.load import FleetLoad, LoadOrder
from gateway.routing.ring import HashRing, LoadBound

#: in-flight per unit of weight of a weight-0 replica (finite, so scores stay numbers)
ZERO_WEIGHT_LOAD = 1e9
#: up to this many replicas (or sqrt(n)) are listed; more are met by walking an order or the ring
LIST_AT_MOST = 16
_REL = 1e-9  # float noise between an order's key and the policy's cost formula
_ABS = 1e-12

Cost = Callable[[int], float]  # a slot's exact cost (the policy's formula)


@dataclass(slots=True)
class Group:
    """Replicas holding the same cached prefix of the request: ``tokens`` of it, ``depth`` keys
    (0 and 0: the free group), as a mask of affinity-index bits."""

    depth: int
    tokens: int
    mask: int
    extra: int = 0  # bound_extra its members get (enough of the prompt cached)
    kept: int = 0  # more room past that, where a spill would not pay for its recompute (spill_min_saving)
    slots: list[int] | None = None  # its members' slots, once listed (small groups)

    @property
    def size(self) -> int:
        return self.mask.bit_count()


@dataclass(slots=True)
class Cheapest:
    """A group's cheapest admitted replica: its cost, order key and slot."""

    cost: float
    key: float
    slot: int


#: (group, order, cost, cost limit, order-key limit): a group's replicas that tie for a pick
Tie = tuple[Group, LoadOrder, Cost, float, float]


class DecisionFleet:
    """One decision's reading of a :class:`FleetLoad` (slots are the load's)."""

    __slots__ = ("all_under", "bits", "bound_of", "load", "mean_weight", "name_of_bit")

    def __init__(self, load: FleetLoad, load_factor: float, bits: list[int], name_of_bit: Callable[[int], str]) -> None:
        self.load = load
        self.bound_of = LoadBound(load_factor, load.total_in_flight, load.weight_sum, load.n, load.uniform)
        self.mean_weight = load.weight_sum / load.n or 1.0
        self.bits = bits  # slot -> its affinity-index bit
        self.name_of_bit = name_of_bit
        self.all_under = False  # no replica under its bound (impossible with c >= 1): all count as under

    # -- one replica -------------------------------------------------------------------
    def bound(self, slot: int) -> int:
        """CHWBL bound of ``slot`` without extra room."""
        return self.bound_of(self.load.weights[slot])

    def busy(self, slot: int) -> float:
        """In flight per unit of weight (scaled by the mean weight); weight 0 looks very busy."""
        load = self.load
        f = load.in_flight[slot]
        if load.uniform:
            return f
        w = load.weights[slot]
        return f * self.mean_weight / w if w > 0 else ZERO_WEIGHT_LOAD + f

    def queued(self, slot: int, weight: float, less: int = 0) -> float:
        """Queued prefill tokens (but ``less`` of them) per unit of weight (scaled by the mean
        weight), x ``weight``."""
        load = self.load
        p = max(0, load.pending[slot] - less)
        w = load.weights[slot]
        return weight * p * self.mean_weight / w if p and w > 0 else 0.0

    def wait(
        self,
        slot: int,
        held: int,
        prompt: int,
        per_request: float,
        queue_weight: float = 1.0,
        recompute: float = 1.0,
        own: Callable[[int], int] | None = None,
    ) -> float:
        """A request's estimated time to first token on ``slot``, in tokens of prefill:
        ``per_request`` per request in flight and the queued prefill (x ``queue_weight``; less
        ``own(slot)`` tokens of it, the requesting flow's own), both per unit of weight, plus its
        own uncached prompt there (``prompt`` less the ``held`` tokens, x ``recompute``)."""
        queued = self.queued(slot, queue_weight, less=own(slot) if own is not None else 0)
        return per_request * self.busy(slot) + queued + recompute * max(0, prompt - held)

    def has_room(self, slot: int, tokens: float) -> bool:
        """Whether ``slot`` has less prefill queued than ``tokens`` (per unit of weight, scaled
        by the mean weight): spare capacity to compute a copy of a shared head that long
        without delaying the work already waiting there."""
        return self.queued(slot, 1.0) < tokens

    def least_queued(self) -> float | None:
        """The least prefill queued on any replica, as :meth:`queued` counts it (O(1): the queued
        order's head); None for no replica."""
        entries = self.load.order(0.0, 1.0).entries
        return self.queued(entries[0][1], 1.0) if entries else None

    def has_room_for(self, tokens: float) -> bool:
        """Whether some replica :meth:`has_room` for ``tokens``."""
        least = self.least_queued()
        return least is not None and least < tokens

    def admitted(self, slot: int, group: Group) -> bool:
        """May take the request: under its bound (with the group's extra room)."""
        return self.all_under or self.load.in_flight[slot] < self.bound(slot) + group.extra + group.kept

    # -- groups ------------------------------------------------------------------------
    def member(self, slot: int, group: Group) -> bool:
        return bool(group.mask >> self.bits[slot] & 1)

    def members(self, group: Group) -> list[int]:
        """The group's slots (O(size), once: for small groups)."""
        if group.slots is None:
            index, name_of = self.load.index, self.name_of_bit
            out = []
            mask = group.mask
            while mask:
                low = mask & -mask
                out.append(index[name_of(low.bit_length() - 1)])
                mask ^= low
            group.slots = out
        return group.slots

    def small(self, group: Group) -> bool:
        """Whether the group is listed (few members) rather than met by walking an order."""
        size = group.size
        return size <= LIST_AT_MOST or size * size <= self.load.n

    def admitted_members(self, group: Group, most: int) -> list[int]:
        """Up to ``most`` admitted members, least busy first when the group is large."""
        if self.small(group):
            return [slot for slot in self.members(group) if self.admitted(slot, group)][:most]
        load = self.load
        limit = math.inf  # in-flight per weight beyond which no member is under its bound
        if not self.all_under and load.weight_sum > 0:
            ratios = ((self.bound_of(w) + group.extra + group.kept) / w for w in load.distinct_weights if w > 0)
            limit = max(ratios, default=0.0)
        out = []
        for key, slot in load.order(1.0, 0.0).entries:
            if key >= limit:
                break
            if self.member(slot, group) and self.admitted(slot, group):
                out.append(slot)
                if len(out) == most:
                    break
        return out

    def idle_member(self, group: Group) -> bool:
        """Whether a member under its bound has nothing in flight (the idle ones lead order (1, 0))."""
        load = self.load
        if self.small(group) or load.weight_sum <= 0:
            return any(load.in_flight[s] == 0 and self.admitted(s, group) for s in self.members(group))
        for key, slot in load.order(1.0, 0.0).entries:
            if key > 0:
                return False
            if self.member(slot, group) and self.admitted(slot, group):
                return True
        return False

    def cheapest(self, group: Group, order: LoadOrder, cost: Cost) -> Cheapest | None:
        """The group's admitted replica of least ``cost`` (None: none admitted)."""
        if self.small(group):
            best: Cheapest | None = None
            for slot in self.members(group):
                if self.admitted(slot, group):
                    c = cost(slot)
                    if best is None or c < best.cost:
                        best = Cheapest(c, order.keys[slot], slot)
            return best
        for key, slot in order.entries:
            if self.member(slot, group) and self.admitted(slot, group):
                return Cheapest(cost(slot), key, slot)
        return None

    def tie(
        self, group: Group, order: LoadOrder, cost: Cost, best: Cheapest, slack: float | None = 0, per_key: float = 0
    ) -> Tie:
        """The group's admitted replicas costing at most ``best``'s cost + ``slack`` (None: any;
        ``per_key``: cost per unit of the order's key, see :meth:`per_key`)."""
        limit = math.inf if slack is None else best.cost + slack
        return group, order, cost, limit, key_limit(best.key, slack, per_key)

    def first_in_ring(self, ring: HashRing, ring_key: int, ties: list[Tie]) -> str:
        """The first in ring order from ``ring_key`` among the replicas of ``ties`` (see
        :meth:`tie`; never all empty).  Listed when few; else found by a ring walk."""
        names = self.load.names
        n = self.load.n
        listed: list[str] = []
        walked: list[Tie] = []
        estimate = 0.0
        for group, order, cost, limit, max_key in ties:
            size = group.size
            count = order.count_upto(max_key)  # replicas of any group within the key limit
            expected = count * size / n  # of this group's, about
            # Listing costs min(size, count) reads; a ring walk about n / expected points.
            if min(size, count) * expected <= n:
                if size <= count:
                    slots: Iterable[int] = self.members(group)
                else:
                    slots = (s for _, s in order.entries[:count] if self.member(s, group))
                listed += [names[s] for s in slots if self.admitted(s, group) and cost(s) <= limit]
            else:
                walked.append((group, order, cost, limit, max_key))
                estimate += expected
        if not walked:
            return listed[0] if len(listed) == 1 else _first(ring, ring_key, listed)
        chosen = set(listed)
        index = self.load.index

        def accept(name: str) -> bool:
            if name in chosen:
                return True
            slot = index.get(name)
            if slot is None:
                return False
            for group, order, cost, limit, max_key in walked:
                if (
                    order.keys[slot] <= max_key
                    and self.member(slot, group)
                    and self.admitted(slot, group)
                    and cost(slot) <= limit
                ):
                    return True
            return False

        # a member of a set holding `estimate` of the ring's members comes every ~len(ring) / estimate points
        pick = ring.first_where(ring_key, accept, 64 + int(8 * len(ring) / max(1.0, estimate)))
        if pick is not None:
            return pick
        # fewer passed than the counts said (most were not admitted): list them after all
        for group, order, cost, limit, max_key in walked:
            count = order.count_upto(max_key)
            listed += [
                names[s]
                for _, s in order.entries[:count]
                if self.member(s, group) and self.admitted(s, group) and cost(s) <= limit
            ]
        return _first(ring, ring_key, listed)

    def per_key(self, a: float, b: float) -> float:
        """Cost per unit of key of ``load.order(a, b)``, for a cost ~ a x busy + b x queued."""
        return (a if a > 0 else b) * self.mean_weight


def key_limit(key: float, slack: float | None, per_key: float) -> float:
    """The largest order key whose cost may be within ``slack`` of the cost at ``key``
    (cost ~ ``per_key`` x key + a constant), with room for float noise."""
    if slack is None or math.isinf(key):
        return math.inf
    if slack:
        if per_key <= 0:
            return math.inf
        key += slack / per_key
    return key + abs(key) * _REL + _ABS


def _first(ring: HashRing, key: int, names: list[str]) -> str:
    pick = ring.first(key, names)
    assert pick is not None  # never empty; the runner's replicas are always admitted to the ring
    return pick
