"""The session policy's spill bound is the shared weighted CHWBL bound (``ring.load_bounds``)."""

from __future__ import annotations

from gateway.routing.base import ReplicaView, RequestView
from gateway.routing.policies.session import SessionPolicy, SessionSettings, rendezvous_order


def _fleet(heavy: int, a: int, b: int) -> list[ReplicaView]:
    return [
        ReplicaView("heavy", weight=2.0, in_flight=heavy),
        ReplicaView("a", weight=1.0, in_flight=a),
        ReplicaView("b", weight=1.0, in_flight=b),
    ]


def test_session_spill_bound_respects_weights() -> None:
    views = _fleet(0, 0, 0)
    key = next(f"s{i}" for i in range(1000) if rendezvous_order(f"s{i}", views)[0].name == "heavy")
    policy = SessionPolicy(SessionSettings(max_load_factor=1.25), views)
    request = RequestView("id", "route", "m", "chat", session_key=key)
    # 3 in flight + this one: the heavy replica's share is 2/4, bound ceil(1.25 x 4 x 0.5) = 3 > 2,
    # so the session stays home (an unweighted bound, ceil(1.25 x 4 / 3) = 2, would spill it).
    assert policy.choose(request, _fleet(2, 1, 0)).reason == "session"
    # 2 in flight on a fleet of 2 + this one: bound ceil(1.25 x 3 x 0.5) = 2, not above 2 -> spill.
    spilled = policy.choose(request, _fleet(2, 0, 0))
    assert spilled.reason == "spill" and spilled.replica != "heavy"
