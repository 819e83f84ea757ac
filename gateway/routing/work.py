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

Decay is lazy, in O(1) per request (:mod:`gateway.routing.decay`).
"""

from __future__ import annotations

from gateway.routing.decay import DecayedCounts, Token


class RecentWork(DecayedCounts):
    """Decayed uncached prompt tokens sent to each replica (the newest request weighs 1)."""

    __slots__ = ()

    def record(self, name: str, tokens: float) -> Token:
        """Count ``tokens`` of prefill sent to ``name``; returns the undo token."""
        return self._add(name, max(0.0, tokens))

    def undo(self, token: Token) -> None:
        """Take back a record whose attempt failed before the replica answered (not for a
        replica that has left since: its work is already out of the total)."""
        if token[1] in self._counts:
            super().undo(token)

    def keep_only(self, names: set[str]) -> None:
        """Forget replicas that left the pool (their work no longer counts in the mean)."""
        for name in [n for n in self._counts if n not in names]:
            self._total = max(0.0, self._total - self._counts.pop(name))

    def snapshot(self) -> dict[str, float]:
        """Each replica's recent work in tokens (for ``/admin/stats``)."""
        unit = self._increment
        return {str(name): round(v / unit, 1) for name, v in sorted(self._counts.items(), key=lambda kv: str(kv[0]))}
