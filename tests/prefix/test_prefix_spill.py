"""A holder over its load bound keeps a request unless a spill pays for its recompute
(``spill_min_saving``): a batch job's burst behind one long document stays on its holder."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.admin.explain import why
from gateway.routing.base import ReplicaView
from gateway.routing.policies.prefix import PrefixPolicy
from tests.prefix.policy_helpers import NAMES, chain, policy, req

DOC = chain(288, 21)  # the job's document: 4,608 tokens, held on r1
ASK = chain(16, 1)  # this request's own instruction: 256 tokens (+3 past the last block)


def _views(in_flight: int, pending: int, others: int = 0) -> list[ReplicaView]:
    """r1 (the holder) with ``in_flight`` requests and ``pending`` prefill tokens queued; the
    other replicas with ``others`` in flight each and nothing queued."""
    return [
        ReplicaView(n, in_flight=in_flight if n == "r1" else others, pending_prefill_tokens=pending if n == "r1" else 0)
        for n in NAMES
    ]


def _holding(**kw: Any) -> PrefixPolicy:
    p = policy(**kw)
    p.index.record("r1", DOC)
    return p


def _r1(detail: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in detail["candidates"] if c["replica"] == "r1")


def test_a_burst_behind_a_long_document_stays_on_its_holder_over_the_bound() -> None:
    # 13 of the job's requests in flight on r1, mostly cached: 3,000 tokens queued.  Its bound is
    # ceil(2 x 14 / 4) + 4 = 11: the textbook rule sends the 14th elsewhere to compute the
    # document again, though r1 would answer it sooner: 3,259 tokens of prefill ahead and 13
    # requests in flight (x 64 tokens) against 4,867 tokens on an idle replica.
    views = _views(13, 3000)
    kept = _holding().peek(req(DOC + ASK), views)
    assert (kept.replica, kept.reason) == ("r1", "affinity")
    assert kept.detail["kept_over_bound"] is True
    assert kept.detail["predicted_cached_tokens"] == 4608
    r1 = _r1(kept.detail)
    assert (r1["bound"], r1["under_bound"], r1["kept_over_bound"]) == (11, False, True)
    spilled = _holding(spill_min_saving=None).choose(req(DOC + ASK), views)
    assert spilled.replica != "r1" and spilled.reason == "spill"
    assert spilled.detail["predicted_cached_tokens"] == 0


def test_the_holder_spills_once_its_queue_outweighs_the_recompute() -> None:
    # A spill to an idle replica saves (queued + 259 + 64 x 13) - 4,867 = queued - 3,776 tokens of
    # wait and recomputes 4,608: with spill_min_saving 3 it pays once queued > 13,824 + 3,776.
    at_limit = _holding().choose(req(DOC + ASK), _views(13, 17_600))
    assert (at_limit.replica, at_limit.reason) == ("r1", "affinity")
    past = _holding().choose(req(DOC + ASK), _views(13, 17_601))
    assert past.replica != "r1" and past.reason == "spill"
    # a smaller factor spills sooner: once queued > 4,608 + 3,776
    early = _holding(spill_min_saving=1).choose(req(DOC + ASK), _views(13, 8_385))
    assert early.replica != "r1" and early.reason == "spill"
    assert _holding(spill_min_saving=1).choose(req(DOC + ASK), _views(13, 8_384)).replica == "r1"


def test_a_flows_own_queue_on_the_holder_buys_no_spill() -> None:
    """As for the copy-saves-wait rule, the requesting flow's own queued prefill does not count
    while another flow shares the route: a batch job's request jumping its own burst's queue would
    recompute the document where the other tenants' requests go next.  Another flow's queue (or
    an anonymous request's, or ``head_copy_own_flow_wait``) still pays for the spill."""

    def fleet(by_flow: dict[str, int]) -> list[ReplicaView]:
        return [
            replace(v, pending_prefill_by_flow=by_flow) if v.name == "r1" else v
            for v in _views(13, sum(by_flow.values()))
        ]

    def decide(flow: str | None, by_flow: dict[str, int], **kw: Any) -> str:
        p = _holding(**kw)
        p.choose(replace(req(chain(20, 77)), flow="id:chat"), _views(0, 0))  # another tenant on the route
        return p.peek(replace(req(DOC + ASK), flow=flow), fleet(by_flow)).replica

    # 20,000 tokens queued on r1 pay for a spill (past 17,600, above) unless they are its own
    assert decide("id:batch", {"id:batch": 20_000}) == "r1"
    assert decide("id:batch", {"id:batch": 1_000, "id:chat": 19_000}) != "r1"
    assert decide("id:chat", {"id:batch": 20_000}) != "r1"
    assert decide(None, {"id:batch": 20_000}) != "r1"
    assert decide("id:batch", {"id:batch": 20_000}, head_copy_own_flow_wait=True) != "r1"


def test_never_past_twice_the_bound() -> None:
    # nothing queued and no in-flight cost: only the cap spills.  (At load_factor 2 on four
    # replicas twice the bound is more than all the requests in flight: the cost comes first.)
    p = _holding(load_factor=1.25, load_cost_tokens=0)
    spilled_at = []
    for n in range(8, 40):
        d = p.peek(req(DOC + ASK), _views(n, 0))
        cap = 2 * _r1(d.detail)["bound"]  # r1's bound with bound_extra
        assert (d.replica == "r1") == (n < cap), (n, cap)
        if d.replica != "r1":
            spilled_at.append(n)
    assert spilled_at


def test_requests_in_flight_count_as_wait() -> None:
    # mostly cached requests queue little prefill, but each one in flight costs load_cost_tokens
    # (64) of wait: 300 of them outweigh four recomputes of the document
    assert _holding().peek(req(DOC + ASK), _views(13, 0)).replica == "r1"
    d = _holding().peek(req(DOC + ASK), _views(300, 0))
    assert d.replica != "r1" and d.reason == "spill"


@pytest.mark.parametrize("blocks", [32, 63])
def test_a_short_popular_prefix_still_spills(blocks: int) -> None:
    # under bound_extra_min_tokens (1,024) cached: spread, as bound_extra is not given there
    head = DOC[:blocks]
    p = policy()
    p.index.record("r1", head)
    d = p.choose(req(head + ASK), _views(13, 0))
    assert d.replica != "r1" and d.reason == "spill"


def test_a_replica_holding_as_much_takes_it_without_a_recompute() -> None:
    # r2 holds the document too and is under its bound: no recompute, so load decides (r2)
    p = _holding()
    p.index.record("r2", DOC)
    d = p.choose(req(DOC + ASK), _views(13, 3000))
    assert (d.replica, d.reason) == ("r2", "affinity")
    assert "kept_over_bound" not in p.peek(req(DOC + ASK), _views(13, 3000)).detail


def test_explain_says_why_it_stayed_over_the_bound() -> None:
    d = _holding().peek(req(DOC + ASK), _views(13, 3000))
    candidates = {c["replica"]: c for c in d.detail["candidates"]}
    plan = SimpleNamespace(decision=d, route=SimpleNamespace(policy="prefix"), request=req(DOC + ASK))
    text = why(plan, candidates)  # type: ignore[arg-type]
    assert "over its load bound" in text and "spill_min_saving" in text and text.startswith("r1 ")
