"""A consistent-hash ring with virtual nodes, and the bounded-load rule (CHWBL).

Each member gets ``round(virtual_nodes x weight)`` points (at least one) at
``xxh3_64("name#i")``; a key (a 64-bit chained block hash) is owned by the first point
clockwise from it.  Walking on from there yields every member once, in a key-specific order
that is the same in every gateway process with the same membership — so several gateways
agree without sharing state, and removing or adding one of N members moves only the keys
that member owned or takes (≈1/N).

The ring is immutable: build a new one when membership or weights change, never per request.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping

import xxhash


def point(name: str, index: int) -> int:
    """Position of ``name``'s ``index``-th virtual node."""
    return xxhash.xxh3_64_intdigest(f"{name}#{index}".encode())


class HashRing:
    """Immutable ring over named, weighted members."""

    def __init__(self, members: Mapping[str, float], virtual_nodes: int = 160) -> None:
        if virtual_nodes < 1:
            raise ValueError("virtual_nodes must be >= 1")
        self.weights: dict[str, float] = dict(sorted(members.items()))
        self.virtual_nodes = virtual_nodes
        names = list(self.weights)
        pairs: list[tuple[int, int]] = []
        for idx, name in enumerate(names):
            weight = self.weights[name]
            if weight < 0 or not math.isfinite(weight):
                raise ValueError(f"weight of {name!r} must be a finite number >= 0")
            count = max(1, round(virtual_nodes * weight))
            pairs.extend((point(name, i), idx) for i in range(count))
        pairs.sort()  # ties (astronomically rare) resolve by member name order: deterministic
        self._names = names
        self._index_of = {n: i for i, n in enumerate(names)}
        self._points = [p for p, _ in pairs]
        self._owners = [o for _, o in pairs]
        # each member's own points, sorted: the first member of a small subset in ring order
        # is found by one bisect per member instead of walking past everyone else's points
        self._member_points: list[list[int]] = [[] for _ in names]
        for p, o in pairs:
            self._member_points[o].append(p)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self.weights

    @property
    def members(self) -> list[str]:
        return list(self._names)

    def walk(self, key: int, only: Iterable[str] | None = None) -> Iterator[str]:
        """Members in ring order starting at ``key``'s position, each once.

        ``only`` restricts the walk to a subset (e.g. the eligible replicas); members not on
        the ring are never yielded.
        """
        if not self._points:
            return
        wanted: set[int] | None = None
        if only is not None:
            index_of = self._index_of
            wanted = {index_of[n] for n in only if n in index_of}
            if not wanted:
                return
        remaining = len(self._names) if wanted is None else len(wanted)
        seen: set[int] = set()
        points, owners, names = self._points, self._owners, self._names
        n = len(points)
        start = bisect_left(points, key & 0xFFFFFFFFFFFFFFFF)
        for step in range(n):
            owner = owners[(start + step) % n]
            if owner in seen or (wanted is not None and owner not in wanted):
                continue
            seen.add(owner)
            yield names[owner]
            remaining -= 1
            if remaining == 0:
                return

    def first(self, key: int, only: Iterable[str]) -> str | None:
        """The first of ``only`` in ring order from ``key``: ``next(walk(key, only))``, in
        O(len(only) x log(points per member)) instead of a walk past the other members' points
        (tens of thousands of steps for two candidates on a 256-member ring)."""
        index_of = self._index_of
        member_points = self._member_points
        k = key & 0xFFFFFFFFFFFFFFFF
        best: tuple[int, int] | None = None
        for name in only:
            idx = index_of.get(name)
            if idx is None:
                continue
            pts = member_points[idx]
            i = bisect_left(pts, k)
            # past the last point the walk wraps around to this member's first point
            candidate = (pts[i] if i < len(pts) else pts[0] + (1 << 64), idx)
            if best is None or candidate < best:
                best = candidate
        return None if best is None else self._names[best[1]]

    def first_where(self, key: int, accept: Callable[[str], bool], max_points: int) -> str | None:
        """The first member in ring order from ``key`` that ``accept`` s, looking at no more
        than ``max_points`` ring points (None: none found within them).

        For a large subset known only by a predicate (say, every replica as idle as the least
        busy one): points of a subset holding a share s of the ring come every ~1/s points,
        so the walk is short exactly when :meth:`first` (one bisect per member of the subset)
        would be long.  ``accept`` is asked once per member.
        """
        points, owners, names = self._points, self._owners, self._names
        n = len(points)
        if not n:
            return None
        rejected: set[int] = set()
        i = bisect_left(points, key & 0xFFFFFFFFFFFFFFFF)
        for _ in range(min(n, max_points)):
            if i == n:
                i = 0
            owner = owners[i]
            i += 1
            if owner in rejected:
                continue
            name = names[owner]
            if accept(name):
                return name
            rejected.add(owner)
        return None

    def owner(self, key: int) -> str | None:
        """The member that owns ``key`` (None on an empty ring)."""
        return next(self.walk(key), None)


class LoadBound:
    """CHWBL capacity by weight for one decision: ``ceil(c x (total_in_flight + 1) x w / W)``.

    The ``+ 1`` counts the request being placed.  With equal weights this is the textbook
    ``ceil(c x (total + 1) / n)``.  A replica may take the request while its in-flight count
    is *below* its bound; since ``c ≥ 1`` the bounds add up to more than the current total,
    so some replica is always under its bound.  Needs only the sums, not a pass over the
    replicas; computed once per distinct weight (usually one).
    """

    __slots__ = ("_by_weight", "_scale", "_uniform")

    def __init__(self, load_factor: float, total_in_flight: int, weight_sum: float, n: int, uniform: bool) -> None:
        total = total_in_flight + 1
        self._by_weight: dict[float, int] = {}
        self._uniform: int | None = None
        self._scale = 0.0
        if uniform:
            self._uniform = math.ceil(round(load_factor * total / n, 9))
        elif weight_sum <= 0:  # no weights at all: every replica counts as weight 1
            self._uniform = math.ceil(round(load_factor * total / n, 9)) if n else 0
        else:
            self._scale = load_factor * total / weight_sum

    def __call__(self, weight: float) -> int:
        if self._uniform is not None:
            return self._uniform
        bound = self._by_weight.get(weight)
        if bound is None:
            # round() first: float noise must not turn an exact 2.0 into a bound of 3
            bound = self._by_weight[weight] = math.ceil(round(self._scale * weight, 9))
        return bound


def load_bounds(in_flight: Mapping[str, int], weights: Mapping[str, float], load_factor: float) -> dict[str, int]:
    """:class:`LoadBound` for each of ``in_flight``'s replicas (an O(n) map, for tests and explain)."""
    weight_sum = sum(weights[name] for name in in_flight)
    bound = LoadBound(load_factor, sum(in_flight.values()), weight_sum, len(in_flight), False)
    return {name: bound(weights[name]) for name in in_flight}
