"""Weighted random choice: the cache-blind baseline that needs no state."""

from __future__ import annotations

import random as _random
from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field

from gateway.routing.base import Decision, PolicySettings, ReplicaView, RequestView


class RandomSettings(PolicySettings):
    seed: int | None = Field(None, description="fixed seed for reproducible benchmarks (default: OS entropy)")


class RandomPolicy:
    name: ClassVar[str] = "random"

    def __init__(self, settings: RandomSettings, members: Sequence[ReplicaView]) -> None:
        self.settings = settings
        self._rng = _random.Random(settings.seed)

    def set_members(self, members: Sequence[ReplicaView]) -> None:
        return None

    def choose(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        return _weighted_pick(self._rng, replicas)

    def peek(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        twin = _random.Random()
        twin.setstate(self._rng.getstate())  # the same draw, without advancing our generator
        return _weighted_pick(twin, replicas)

    def observe(self, request: RequestView, decision: Decision, cached_tokens: int | None) -> None:
        return None


def _weighted_pick(rng: _random.Random, replicas: Sequence[ReplicaView]) -> Decision:
    if len(replicas) == 1:
        return Decision(replicas[0].name, "random")
    weights = [r.weight for r in replicas]
    if all(w == weights[0] for w in weights):
        pick = replicas[rng.randrange(len(replicas))]
    else:
        pick = rng.choices(replicas, weights=weights, k=1)[0]
    return Decision(pick.name, "random")
