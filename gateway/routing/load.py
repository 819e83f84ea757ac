"""The eligible replicas' load, kept up to date as it changes, so a decision need not scan the fleet.

A decision needs a few fleet-wide numbers — the total in flight (for the CHWBL bound), the
weights, which replicas are least busy by some cost — and otherwise only the replicas the
affinity index matched (a handful).  Reading every replica per request made the route stage
grow linearly with the fleet (about 1 ms at 256 replicas).  :class:`FleetLoad` keeps instead:

- ``n``, the in-flight and weight sums, whether all weights are equal: updated in O(1) when
  a replica's load changes;
- for each cost ``(a x in_flight + b x queued prefill) / weight`` a policy asked for, the
  replicas sorted by it (:class:`LoadOrder`: built the first time, then moved one entry per
  change — a bisect and a memmove of pointers).  The least busy few are its first entries;
  ``count_upto`` says in O(log n) how many are within a limit.

The route runner owns the live one: it watches its replicas (``Replica.watch``) and
rebuilds it when the eligible set changes (health, slow flag, membership), which is rare.
A policy handed plain views (tests, a retry that excludes a replica) takes a snapshot with
:meth:`FleetLoad.of` and decides with the same code.

Not thread-safe: the gateway runs on one event loop, and nothing changes during a decision.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Iterator, Sequence

from gateway.routing.base import ReplicaView

#: distinct cost orders kept per fleet (a policy uses two or three)
MAX_ORDERS = 8
_INF = math.inf


class LoadOrder:
    """The fleet's replicas (slots) sorted by ``(a x in_flight + b x pending) / weight``.

    Weight-0 replicas sort last (key infinity): they never take work by weight.
    """

    __slots__ = ("a", "b", "entries", "keys")

    def __init__(self, a: float, b: float, load: FleetLoad) -> None:
        self.a = a
        self.b = b
        self.keys = [self.key(f, p, w) for f, p, w in zip(load.in_flight, load.pending, load.weights, strict=True)]
        self.entries: list[tuple[float, int]] = sorted((k, i) for i, k in enumerate(self.keys))

    def key(self, in_flight: int, pending: int, weight: float) -> float:
        return (self.a * in_flight + self.b * pending) / weight if weight > 0 else _INF

    def move(self, slot: int, key: float) -> None:
        old = self.keys[slot]
        if key == old:
            return
        entries = self.entries
        del entries[bisect_left(entries, (old, slot))]
        insort(entries, (key, slot))
        self.keys[slot] = key

    def count_upto(self, limit: float) -> int:
        """How many replicas have a key of at most ``limit`` (O(log n))."""
        return bisect_right(self.entries, (limit, _INF))

    def slots(self) -> Iterator[int]:
        """Slots from the least key up (ties: in pool order)."""
        for _, slot in self.entries:
            yield slot


class FleetLoad:
    """Load of a fixed set of replicas (slots in pool order): sums and sorted cost orders."""

    __slots__ = (
        "_orders",
        "distinct_weights",
        "in_flight",
        "index",
        "names",
        "pending",
        "total_in_flight",
        "uniform",
        "weight_sum",
        "weights",
    )

    def __init__(
        self, names: Sequence[str], weights: Sequence[float], in_flight: Iterable[int], pending: Iterable[int]
    ) -> None:
        self.names = list(names)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.weights = [float(w) for w in weights]
        self.in_flight = list(in_flight)
        self.pending = list(pending)
        self.total_in_flight = sum(self.in_flight)
        self.weight_sum = sum(self.weights)
        self.distinct_weights = frozenset(self.weights)
        first = self.weights[0] if self.weights else 0.0
        self.uniform = first > 0 and all(w == first for w in self.weights)
        self._orders: dict[tuple[float, float], LoadOrder] = {}

    @classmethod
    def of(cls, views: Sequence[ReplicaView]) -> FleetLoad:
        """A snapshot of ``views`` (O(n)): for callers without a live one."""
        return cls(
            [v.name for v in views],
            [v.weight for v in views],
            [v.in_flight for v in views],
            [v.pending_prefill_tokens for v in views],
        )

    @property
    def n(self) -> int:
        return len(self.names)

    def order(self, a: float, b: float) -> LoadOrder:
        """The replicas sorted by ``(a x in_flight + b x pending) / weight``, kept from now on.

        Proportional costs share one order: its keys are those of ``(1, b / a)`` (or ``(0, 1)``
        when ``a`` is 0), i.e. the cost divided by ``a`` (or ``b``).
        """
        if a > 0:
            a, b = 1.0, b / a
        else:
            a, b = 0.0, 1.0 if b > 0 else 0.0
        order = self._orders.get((a, b))
        if order is None:
            if len(self._orders) >= MAX_ORDERS:  # settings changed under us: keep the newest few
                self._orders.pop(next(iter(self._orders)))
            order = self._orders[(a, b)] = LoadOrder(a, b, self)
        return order

    def least_loaded(self, turn: int) -> int:
        """:func:`~gateway.routing.policies.least_loaded.least_loaded` in O(log n): the slot with
        the least in-flight per unit of weight, ``turn`` rotating among ties in pool order."""
        order = self.order(1.0, 0.0)
        entries = order.entries
        return entries[turn % order.count_upto(entries[0][0])][1]

    def add(self, slot: int, in_flight: int, pending: int) -> None:
        """Replica ``slot``'s in-flight count moved by ``in_flight``, its queued prefill by ``pending``."""
        f = self.in_flight[slot] = self.in_flight[slot] + in_flight
        p = self.pending[slot] = self.pending[slot] + pending
        self.total_in_flight += in_flight
        w = self.weights[slot]
        for order in self._orders.values():
            order.move(slot, order.key(f, p, w))


class FleetViews(tuple):  # type: ignore[type-arg]  # a tuple of ReplicaView
    """The eligible replicas' views (a plain sequence for every policy), plus their live
    :class:`FleetLoad` for the policies that use it instead of reading every view."""

    load: FleetLoad

    def __new__(cls, views: Iterable[ReplicaView], load: FleetLoad) -> FleetViews:
        self = super().__new__(cls, views)
        self.load = load
        return self


def fleet_load(views: Sequence[ReplicaView]) -> FleetLoad:
    """The live load the runner attached to ``views``, else a snapshot of them."""
    load = getattr(views, "load", None)
    return load if isinstance(load, FleetLoad) else FleetLoad.of(views)
