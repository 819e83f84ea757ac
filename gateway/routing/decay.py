"""Counts that decay geometrically with every addition, in O(1) per add and per read.

Head demand (:mod:`gateway.routing.starts`) and recent prefill work (:mod:`gateway.routing.work`)
both weigh what happened ``window`` additions ago by 1/e.  Multiplying every count on each
addition would cost a pass over all of them; instead each addition is scaled by a growing
increment and reads divide by it, and the stored numbers are renormalised (every count
divided once) long before the increment could overflow.  An addition's undo token names the
renormalisation epoch it belongs to: after a renormalisation it no longer applies (a rare,
harmless miss), never subtracts the wrong amount.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable

_RESCALE_AT = 1e100  # the growing increment is renormalised long before floats overflow

Token = tuple[int, Hashable, float]  # (epoch, key, scaled amount)


class DecayedCounts:
    """Decayed counts per key and in total (the newest addition of 1 weighs 1); keys in order of
    their last addition, oldest first (subclasses bound them as an LRU)."""

    __slots__ = ("_counts", "_epoch", "_growth", "_increment", "_total")

    def __init__(self, window: int) -> None:
        self._growth = math.exp(1.0 / max(1, window))
        self._increment = 1.0
        self._counts: OrderedDict[Hashable, float] = OrderedDict()
        self._total = 0.0
        self._epoch = 0

    def count(self, key: Hashable) -> float:
        return self._counts.get(key, 0.0) / self._increment

    def total(self) -> float:
        return self._total / self._increment

    def _add(self, key: Hashable, amount: float) -> Token:
        """Add ``amount`` (>= 0) under ``key``, decaying everything before by one step."""
        self._increment *= self._growth
        if self._increment > _RESCALE_AT:
            unit = self._increment
            self._counts = OrderedDict((k, v / unit) for k, v in self._counts.items())
            self._total /= unit
            self._increment = 1.0
            self._epoch += 1
        scaled = amount * self._increment
        self._total += scaled
        self._counts[key] = self._counts.pop(key, 0.0) + scaled  # most recent last
        return self._epoch, key, scaled

    def undo(self, token: Token) -> None:
        """Take back an addition (an attempt that failed before the replica answered)."""
        epoch, key, scaled = token
        if epoch != self._epoch:
            return
        self._total = max(0.0, self._total - scaled)
        if key in self._counts:
            self._counts[key] = max(0.0, self._counts[key] - scaled)
