"""Recent prefill work per replica: where new conversations start, for balance over minutes.

A conversation stays where it starts (its history is cached there), so the prefill work a
replica does over the next minutes is decided by the conversations that started on it.
Behind a tenant's shared head they all start on the head's holder: with six tenants of
similar traffic on four replicas one holder per head gives 2, 2, 1 and 1 tenants, and the
busiest replica ends the run with ~1.3x the mean prefill work however well each decision
is balanced in the moment (in-flight counts even out within seconds; tenants don't).

So the ``prefix`` policy counts the uncached prompt tokens it sends each replica (its own
prediction, decayed over ``window`` requests).  A new conversation behind a shared head
whose holder has done more than ``start_work_factor`` x the mean (and more than the mean +
the head's length: a copy must be worth its cost) starts on the least-worked holder under
that limit, or, when every holder is over it, on the replica that did the least: that one
computes the head once, becomes a holder, and the tenant is shared from then on.  The
decision is ``PrefixPolicy._least_worked``; this module only keeps the counts.

Decay is lazy, as in :mod:`gateway.routing.starts`: each record adds a growing increment
instead of multiplying every count, so recording and reading are O(1).
"""

from __future__ import annotations

import math

_RESCALE_AT = 1e100  # the growing increment is renormalised long before floats overflow


class RecentWork:
    """Decayed uncached prompt tokens sent to each replica (the newest request weighs 1)."""

    __slots__ = ("_epoch", "_growth", "_increment", "_per_replica", "_total")

    def __init__(self, window: int) -> None:
        self._growth = math.exp(1.0 / max(1, window))
        self._increment = 1.0
        self._per_replica: dict[str, float] = {}
        self._total = 0.0
        self._epoch = 0  # bumps on renormalisation: an older undo token no longer applies

    def of(self, name: str) -> float:
        return self._per_replica.get(name, 0.0) / self._increment

    def total(self) -> float:
        return self._total / self._increment

    def record(self, name: str, tokens: float) -> tuple[int, str, float]:
        """Count ``tokens`` of prefill sent to ``name``; returns the undo token."""
        self._increment *= self._growth
        if self._increment > _RESCALE_AT:
            unit = self._increment
            self._per_replica = {k: v / unit for k, v in self._per_replica.items()}
            self._total /= unit
            self._increment = 1.0
            self._epoch += 1
        amount = max(0.0, tokens) * self._increment
        self._per_replica[name] = self._per_replica.get(name, 0.0) + amount
        self._total += amount
        return self._epoch, name, amount

    def undo(self, token: tuple[int, str, float]) -> None:
        """Take back a record whose attempt failed before the replica answered."""
        epoch, name, amount = token
        if epoch != self._epoch or name not in self._per_replica:
            return
        self._per_replica[name] = max(0.0, self._per_replica[name] - amount)
        self._total = max(0.0, self._total - amount)

    def keep_only(self, names: set[str]) -> None:
        """Forget replicas that left the pool (their work no longer counts in the mean)."""
        for name in [n for n in self._per_replica if n not in names]:
            self._total = max(0.0, self._total - self._per_replica.pop(name))

    def snapshot(self) -> dict[str, float]:
        """Each replica's recent work in tokens (for ``/admin/stats``)."""
        unit = self._increment
        return {name: round(v / unit, 1) for name, v in sorted(self._per_replica.items())}
