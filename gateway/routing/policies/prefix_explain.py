"""The per-candidate table of ``/admin/explain`` for the ``prefix`` policy.

Explain-only: it walks the whole ring and passes over every replica, which real requests
never pay for (the decision itself reads the fleet by group, see
:mod:`gateway.routing.policies.prefix_fleet`).  Kept apart so the decision module holds
only what every request runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.routing.base import ReplicaView
from gateway.routing.policies.prefix_fleet import DecisionFleet, Group
from gateway.routing.ring import HashRing


def candidate_table(
    fleet: DecisionFleet,
    ring: HashRing,
    ring_key: int,
    replicas: Sequence[ReplicaView],
    groups: list[Group],
    free: Group,
    has_match: bool,
    queue_weight: float,
    load_cost_tokens: float,
) -> list[dict[str, Any]]:
    """Every replica in ring order from the key: its load, bound, match and (when some
    replica under its bound has a match) the generic affinity score."""
    load = fleet.load
    group_of = {load.names[slot]: group for group in groups for slot in fleet.members(group)}
    lc = load_cost_tokens
    by_name = {r.name: r for r in replicas}
    out = []
    for rank, name in enumerate(ring.walk(ring_key, by_name)):
        r = by_name[name]
        slot = load.index[name]
        group = group_of.get(name, free)
        bound = fleet.bound(slot) + group.extra
        entry: dict[str, Any] = {
            "replica": name,
            "ring_rank": rank,
            "weight": r.weight,
            "in_flight": r.in_flight,
            "pending_prefill_tokens": r.pending_prefill_tokens,
            "bound": bound,
            "under_bound": r.in_flight < bound,
            "kept_over_bound": r.in_flight >= bound and fleet.admitted(slot, group),  # see spill_min_saving
            "matched_blocks": group.depth,
            "matched_tokens": group.tokens,
        }
        if has_match and fleet.admitted(slot, group):  # the generic score, on every branch
            entry["score"] = group.tokens - lc * fleet.busy(slot) - fleet.queued(slot, queue_weight)
        out.append(entry)
    return out
