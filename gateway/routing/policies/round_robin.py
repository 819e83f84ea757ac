"""Round robin (smooth weighted, nginx-style): spreads requests in proportion to weights.

Smooth weighted round robin interleaves heavy and light replicas instead of sending bursts,
and needs no rebuild when the eligible set changes (an unhealthy replica simply stops
accumulating credit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from gateway.routing.base import Decision, PolicySettings, ReplicaView, RequestView


class RoundRobinSettings(PolicySettings):
    """No settings: weights come from the replicas."""


class RoundRobinPolicy:
    name: ClassVar[str] = "round_robin"

    def __init__(self, settings: RoundRobinSettings, members: Sequence[ReplicaView]) -> None:
        self.settings = settings
        self._credit: dict[str, float] = {m.name: 0.0 for m in members}

    def set_members(self, members: Sequence[ReplicaView]) -> None:
        self._credit = {m.name: self._credit.get(m.name, 0.0) for m in members}

    def choose(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        return _smooth_pick(self._credit, replicas)

    def peek(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        return _smooth_pick(dict(self._credit), replicas)

    def observe(self, request: RequestView, decision: Decision, cached_tokens: int | None) -> None:
        return None


def _smooth_pick(credit: dict[str, float], replicas: Sequence[ReplicaView]) -> Decision:
    """One step of smooth weighted round robin; updates ``credit`` in place."""
    best: ReplicaView | None = None
    best_credit = 0.0
    total = 0.0
    for replica in replicas:
        value = credit.get(replica.name, 0.0) + replica.weight
        credit[replica.name] = value
        total += replica.weight
        if best is None or value > best_credit:
            best, best_credit = replica, value
    assert best is not None
    credit[best.name] = best_credit - total
    return Decision(best.name, "round_robin")
