"""Least loaded: the replica with the fewest in-flight requests per unit of weight.

In-flight counts come from the gateway itself at decision time (a metrics scrape is seconds
stale and sends bursts to whichever replica looked idle).  Ties rotate instead of always
taking the first replica, which would pin all low-load traffic to replica 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field

from gateway.routing.base import Decision, PolicySettings, ReplicaView, RequestView


class LeastLoadedSettings(PolicySettings):
    count_engine_waiting: bool = Field(
        False, description="add the replica's scraped vllm:num_requests_waiting to its load (stale by up to a scrape)"
    )


def least_loaded(replicas: Sequence[ReplicaView], turn: int, count_waiting: bool = False) -> ReplicaView:
    """The least loaded replica; ``turn`` rotates among ties.  Shared with fallbacks of other policies."""
    best: list[ReplicaView] = []
    best_load = 0.0
    for replica in replicas:
        load = replica.in_flight
        if count_waiting and replica.num_waiting:
            load += replica.num_waiting
        load /= replica.weight
        if not best or load < best_load:
            best, best_load = [replica], load
        elif load == best_load:
            best.append(replica)
    return best[turn % len(best)]


class LeastLoadedPolicy:
    name: ClassVar[str] = "least_loaded"

    def __init__(self, settings: LeastLoadedSettings, members: Sequence[ReplicaView]) -> None:
        self.settings = settings
        self._turn = 0

    def set_members(self, members: Sequence[ReplicaView]) -> None:
        return None

    def choose(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        decision = self.peek(request, replicas)
        self._turn += 1
        return decision

    def peek(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        pick = least_loaded(replicas, self._turn + 1, self.settings.count_engine_waiting)
        return Decision(pick.name, "least_loaded")

    def observe(self, request: RequestView, decision: Decision, cached_tokens: int | None) -> None:
        return None
