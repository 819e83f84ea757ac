"""Session affinity: a consistent hash of a header value (e.g. ``x-session-id``).

Rendezvous (highest-random-weight) hashing: each replica scores ``weight / -ln(u)`` with
``u`` a stable xxh3 hash of (replica, session) mapped to (0, 1); the best score wins.  It is
deterministic across gateway processes, respects weights, and when a replica leaves (or
turns unhealthy) only the sessions it held move.  Requests without the header fall back to
least loaded.  An optional load bound lets a session spill to its next-best replica when its
home is overloaded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import xxhash
from pydantic import Field

from gateway.routing.base import Decision, PolicySettings, ReplicaView, RequestView
from gateway.routing.policies.least_loaded import least_loaded
from gateway.routing.ring import load_bounds

_TWO_64 = float(2**64)


class SessionSettings(PolicySettings):
    max_load_factor: float | None = Field(
        None,
        gt=1.0,
        description="if set, spill past a replica whose in-flight count reaches its weighted CHWBL bound "
        "ceil(factor x (total + 1) x weight / total weight); "
        "default: pin strictly",
    )


def rendezvous_order(key: str, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    """Replicas from most to least preferred for ``key`` (ties broken by name)."""
    scored = []
    for replica in replicas:
        h = xxhash.xxh3_64_intdigest(f"{replica.name}\x00{key}".encode())
        u = (h + 0.5) / _TWO_64
        scored.append((replica.weight / -math.log(u), replica.name, replica))
    scored.sort(key=lambda t: (-t[0], t[1]))
    return [t[2] for t in scored]


class SessionPolicy:
    name: ClassVar[str] = "session"

    def __init__(self, settings: SessionSettings, members: Sequence[ReplicaView]) -> None:
        self.settings = settings
        self._turn = 0

    def set_members(self, members: Sequence[ReplicaView]) -> None:
        return None

    def choose(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        decision = self.peek(request, replicas)
        if decision.reason == "fallback":
            self._turn += 1  # ties among least-loaded replicas rotate
        return decision

    def peek(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        if not request.session_key:
            return Decision(least_loaded(replicas, self._turn + 1).name, "fallback")
        order = rendezvous_order(request.session_key, replicas)
        factor = self.settings.max_load_factor
        if factor is None or len(order) == 1:
            return Decision(order[0].name, "session")
        # The same weighted CHWBL bound as the prefix policy (one rule, one place).
        bounds = load_bounds({r.name: r.in_flight for r in replicas}, {r.name: r.weight for r in replicas}, factor)
        for rank, replica in enumerate(order):
            if replica.in_flight < bounds[replica.name]:
                return Decision(replica.name, "session" if rank == 0 else "spill")
        return Decision(order[0].name, "session")

    def observe(self, request: RequestView, decision: Decision, cached_tokens: int | None) -> None:
        return None
