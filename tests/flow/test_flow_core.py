"""The pure flow-control core: saturation, the fair priority queue, the dispatcher, classification."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

import pytest
from pydantic import ValidationError

from gateway.config import HealthSettings, ReplicaConfig
from gateway.flow.classify import classify, named_flow, vllm_priority
from gateway.flow.dispatch import Dispatcher, admit
from gateway.flow.gate import route_room
from gateway.flow.queue import DISPATCHED, EXPIRED, REMOVED, Entry, FlowQueue, QueueFull
from gateway.flow.saturation import Signals, full_reason, room, saturated
from gateway.flow.settings import FlowControlSettings, SaturationSettings
from gateway.replicas.engine import EngineStats
from gateway.replicas.pool import Replica
from gateway.routing.base import Decision, RequestView
from gateway.routing.runner import PolicyRunner


def limits_of(max_requests: int = 1000, max_bytes: int = 10**9, ttl: float = 30.0):
    return lambda priority: (max_requests, max_bytes, ttl)


# -- saturation --------------------------------------------------------------------------
def test_room_from_the_gateways_own_counts() -> None:
    limits = SaturationSettings(queued_prefill_tokens=1000, in_flight=4, waiting=0, kv_cache_usage=0)
    assert full_reason(Signals(in_flight=3, pending_prefill_tokens=999), limits, 0.0) is None
    assert full_reason(Signals(pending_prefill_tokens=1000), limits, 0.0) == "queued_prefill"
    assert full_reason(Signals(in_flight=4), limits, 0.0) == "in_flight"


def test_scraped_numbers_only_say_no_room_and_a_stale_one_is_full_alone() -> None:
    limits = SaturationSettings(waiting=2, running=10, kv_cache_usage=0.9, scrape_stale_s=5)
    fresh = dict(scraped_at=100.0)
    assert full_reason(Signals(waiting=1, running=9, kv_cache_usage=0.5, **fresh), limits, 101.0) is None
    assert full_reason(Signals(waiting=2, **fresh), limits, 101.0) == "waiting"
    assert full_reason(Signals(running=10, **fresh), limits, 101.0) == "running"
    assert full_reason(Signals(kv_cache_usage=0.95, **fresh), limits, 101.0) == "kv_cache"
    assert full_reason(Signals(waiting=0, **fresh), limits, 105.5) == "stale"
    # never scraped (scraping off): judged on the gateway's counts alone
    assert full_reason(Signals(), limits, 1e9) is None


def test_stale_scrapes_are_no_room_beside_a_fresh_one_and_left_out_when_every_one_is_stale() -> None:
    """A /metrics that broke on every replica must not read as a full fleet: that held every
    request to its TTL (503).  Beside a replica with fresh numbers a stale one has no room."""
    limits = SaturationSettings(queued_prefill_tokens=1000, waiting=2, scrape_stale_s=5)
    stale_idle = Signals(waiting=0, scraped_at=0.0)
    stale_busy = Signals(waiting=9, scraped_at=0.0, pending_prefill_tokens=1000)
    fresh_full = Signals(waiting=2, scraped_at=99.0)
    assert room([stale_idle, fresh_full], limits, 100.0) == ["stale", "waiting"]
    assert saturated([stale_idle, fresh_full], limits, 100.0)
    # every scrape stale: the engines' old numbers say nothing; the gateway's own counts still do
    assert room([stale_idle, stale_busy], limits, 100.0) == [None, "queued_prefill"]
    assert not saturated([stale_idle, stale_busy], limits, 100.0)
    assert saturated([stale_busy], limits, 100.0)
    assert room([stale_idle, Signals()], limits, 100.0) == [None, None]  # never scraped is no fresher


def test_a_scraped_waiting_queue_counts_down_with_each_answer_until_the_next_scrape() -> None:
    """Scrapes are seconds apart: a queue the engine has worked through since must not keep
    the replica "full" until the next one (on the saturated RAG replay that starved the
    engines: TTFT p90 2.7x the route without flow control; 1.05x counting answers)."""
    replica = Replica(ReplicaConfig(name="r0", url="http://h:1"), None, HealthSettings())  # type: ignore[arg-type]
    limits = SaturationSettings(queued_prefill_tokens=0, waiting=8, kv_cache_usage=0, scrape_stale_s=0)
    replica.set_engine(EngineStats(0.0, waiting=9.0))
    assert route_room([replica], limits, 1.0)["r0"] == "waiting"
    PolicyRunner.answered(replica, 0)
    assert replica.waiting_now == 8.0 and route_room([replica], limits, 1.0)["r0"] == "waiting"
    PolicyRunner.answered(replica, 0)
    assert replica.waiting_now == 7.0 and route_room([replica], limits, 1.0)["r0"] is None
    replica.set_engine(EngineStats(2.0, waiting=8.0))  # the next scrape is the word again
    assert route_room([replica], limits, 2.0)["r0"] == "waiting"
    for _ in range(20):
        PolicyRunner.answered(replica, 0)
    assert replica.waiting_now == 0.0  # never below an empty queue


def test_the_prefill_limit_counts_the_work_queued_behind_the_one_under_way() -> None:
    """One long prompt alone must not fill a replica: its engine would then get the next request
    only at that prompt's first token, a step late, and run a step without prefill."""
    replica = Replica(ReplicaConfig(name="r0", url="http://h:1"), None, HealthSettings())  # type: ignore[arg-type]
    limits = SaturationSettings(queued_prefill_tokens=1000, waiting=0, kv_cache_usage=0)
    first = replica.charge_prefill(5000)  # the engine computes this one now
    assert replica.head_prefill_tokens == 5000 and route_room([replica], limits, 0.0)["r0"] is None
    second = replica.charge_prefill(600)
    assert route_room([replica], limits, 0.0)["r0"] is None
    third = replica.charge_prefill(400)
    assert replica.pending_prefill_tokens == 6000 and route_room([replica], limits, 0.0)["r0"] == "queued_prefill"
    PolicyRunner.prefill_done(replica, first)  # answered: the next oldest is under way
    assert replica.head_prefill_tokens == 600 and route_room([replica], limits, 0.0)["r0"] is None
    PolicyRunner.prefill_done(replica, third)  # out of order (an attempt that failed): its own ticket
    assert replica.head_prefill_tokens == 600 and replica.pending_prefill_tokens == 600
    PolicyRunner.prefill_done(replica, second)
    assert replica.head_prefill_tokens == 0 and replica.pending_prefill_tokens == 0
    assert full_reason(Signals(pending_prefill_tokens=1500, head_prefill_tokens=500), limits, 0.0) == "queued_prefill"


def test_an_attempt_counts_one_answer_at_its_first_byte_and_none_again_at_its_end() -> None:
    from types import SimpleNamespace

    from gateway.routing.attempt import Attempt

    replica = Replica(ReplicaConfig(name="r0", url="http://h:1"), None, HealthSettings())  # type: ignore[arg-type]
    route = SimpleNamespace(runner=SimpleNamespace(release=lambda *args: None))
    plan = SimpleNamespace(route=route, request=SimpleNamespace(prompt_tokens_estimate=100))
    replica.pending_prefill_tokens = 60
    attempt = Attempt(plan, None, replica, charged=60)  # type: ignore[arg-type]
    attempt.answered()
    attempt.release(0, completed=False, served=True)
    assert replica.answers == 1 and replica.pending_prefill_tokens == 0


def test_a_route_is_saturated_when_no_replica_has_room() -> None:
    limits = SaturationSettings(in_flight=1)
    assert saturated([Signals(in_flight=1), Signals(in_flight=2)], limits, 0.0)
    assert not saturated([Signals(in_flight=1), Signals(in_flight=0)], limits, 0.0)
    assert not saturated([], limits, 0.0)  # no eligible replica: down (503), not saturated


# -- the queue ---------------------------------------------------------------------------
def test_strict_priority_between_bands_fcfs_within_a_flow() -> None:
    q = FlowQueue(limits_of())
    low = [q.push("a", 0, 10, 1, now=float(i)) for i in range(3)]
    high = q.push("b", 5, 10, 1, now=10.0)
    sheddable = q.push("c", -1, 10, 1, now=0.0)
    assert q.pop() is high
    assert [q.pop() for _ in range(3)] == low
    assert q.pop() is sheddable
    assert q.pop() is None and len(q) == 0


def test_fair_share_of_prompt_work_between_flows() -> None:
    """A flood of 10x the requests gets one share of the dispatched work, not ten."""
    q = FlowQueue(limits_of())
    for i in range(100):
        q.push("flood", 0, 100, 1, now=0.0, item=i)
    for i in range(10):
        q.push("quiet", 0, 100, 1, now=0.0, item=i)
    first = [q.pop().flow for _ in range(20)]  # type: ignore[union-attr]
    assert Counter(first) == {"flood": 10, "quiet": 10}
    # by work, not by requests: a flow with 4x longer prompts gets a quarter of the requests
    q = FlowQueue(limits_of())
    for _ in range(50):
        q.push("long", 0, 400, 1, now=0.0)
        q.push("short", 0, 100, 1, now=0.0)
    picks = Counter(q.pop().flow for _ in range(25))  # type: ignore[union-attr]
    assert picks["short"] == 20 and picks["long"] == 5


def test_the_look_past_window_is_the_pop_order() -> None:
    """``candidates(n)`` lists, over every flow's entries, what ``n`` pops would take."""
    q = FlowQueue(limits_of())
    for _ in range(30):
        q.push("long", 0, 400, 1, now=0.0)
        q.push("short", 0, 100, 1, now=0.0)
    q.push("high", 5, 100, 1, now=0.0)
    assert [e.flow for e in q.candidates(3)] == ["high"]  # the most important band only
    q.pop()
    window = q.candidates(12)
    assert window == [q.pop() for _ in range(12)]  # type: ignore[comparison-overlap]
    assert Counter(e.flow for e in window) == {"short": 9, "long": 3}


def test_an_idle_flow_banks_no_credit_and_waits_behind_no_backlog() -> None:
    q = FlowQueue(limits_of())
    for _ in range(50):
        q.push("flood", 0, 100, 1, now=0.0)
    for _ in range(30):
        q.pop()
    late = q.push("quiet", 0, 100, 1, now=1.0)
    # it starts at the band's clock: next or the one after, never behind the 20 left
    assert late in (q.pop(), q.pop())


def test_bounds_in_requests_and_bytes_per_band() -> None:
    q = FlowQueue(lambda p: (2, 100, 30.0) if p == 0 else (10, 1000, 30.0))
    q.push("a", 0, 1, 10, now=0.0)
    q.push("a", 0, 1, 10, now=0.0)
    with pytest.raises(QueueFull) as full:
        q.push("a", 0, 1, 10, now=0.0)
    assert full.value.what == "requests"
    q.push("a", 1, 1, 900, now=0.0)  # another band, its own bounds
    with pytest.raises(QueueFull) as full:
        q.push("a", 1, 1, 101, now=0.0)
    assert full.value.what == "bytes"


def test_remove_from_anywhere_and_expiry() -> None:
    q = FlowQueue(lambda p: (100, 10**6, 5.0))
    a = q.push("f", 0, 1, 1, now=0.0)
    b = q.push("f", 0, 1, 1, now=1.0)
    c = q.push("f", 0, 1, 1, now=2.0)
    assert q.remove(b) and b.state == REMOVED and not q.remove(b)
    assert q.remove(a)  # the head: the flow's next one becomes the head
    assert q.next_deadline() == 7.0
    assert q.expire(6.9) == []
    assert q.expire(7.0) == [c] and c.state == EXPIRED
    assert len(q) == 0 and q.peek() is None and q.next_deadline() is None


def test_snapshot_and_ahead_of() -> None:
    q = FlowQueue(limits_of())
    q.push("a", 1, 1, 5, now=0.0)
    q.push("b", 1, 1, 5, now=0.0)
    e = q.push("c", 0, 1, 7, now=0.0)
    assert q.ahead_of(e) == {1: 2}
    snap = q.snapshot()
    assert snap[1] == {"depth": 2, "bytes": 10, "flows": {"a": 1, "b": 1}}
    assert snap[0]["depth"] == 1


def test_many_flows_stay_cheap_and_consistent() -> None:
    q = FlowQueue(limits_of(max_requests=100_000))
    entries = [q.push(f"f{i % 500}", i % 3, 1 + i % 7, 10, now=i * 1e-3) for i in range(5000)]
    for e in entries[::3]:
        q.remove(e)
    seen = 0
    last_priority = 10
    while (e := q.pop()) is not None:
        assert e.state == DISPATCHED
        assert e.priority <= last_priority
        last_priority = e.priority
        seen += 1
    assert seen == 5000 - len(entries[::3])


# -- dispatch ----------------------------------------------------------------------------
class FakeFleet:
    """Replicas with a slot count each; ``favourite`` says where the policy would go."""

    def __init__(self, slots: dict[str, int], favourite: str | None = None) -> None:
        self.free = dict(slots)
        self.favourite = favourite
        self.placed: list[tuple[object, str]] = []

    def with_room(self, now: float) -> Collection[str]:
        return [name for name, n in self.free.items() if n > 0]

    def preferred(self, entry: Entry) -> str | None:
        return self.favourite

    def place(self, entry: Entry, allowed: Collection[str]) -> str | None:
        name = self.favourite if self.favourite in allowed else sorted(allowed)[0]
        self.free[name] -= 1
        self.placed.append((entry.item, name))
        return name


def test_admission() -> None:
    assert admit(saturated=False, queued=0, priority=-5) == "direct"
    assert admit(saturated=False, queued=3, priority=0) == "queue"
    assert admit(saturated=True, queued=0, priority=0) == "queue"
    assert admit(saturated=True, queued=0, priority=-1) == "shed"


def test_dispatch_fills_the_room_there_is_in_queue_order() -> None:
    q = FlowQueue(limits_of(ttl=10.0))
    for i in range(5):
        q.push("f", 0, 1, 1, now=0.0, item=i)
    fleet = FakeFleet({"r1": 1, "r2": 2})
    step = Dispatcher(q).step(fleet, now=1.0)
    assert [e.item for e, _ in step.dispatched] == [0, 1, 2]
    assert sorted(p for _, p in step.dispatched) == ["r1", "r2", "r2"]
    assert len(q) == 2 and step.wake_at == 10.0  # the TTL of what is left


def test_late_binding_goes_to_the_favourite_once_it_has_room() -> None:
    q = FlowQueue(limits_of())
    q.push("f", 0, 1, 1, now=0.0, item="x")
    fleet = FakeFleet({"r1": 0, "r2": 1}, favourite="r1")
    d = Dispatcher(q, affinity_wait_s=0.5)
    step = d.step(fleet, now=0.1)
    assert step.dispatched == [] and step.wake_at == 0.1 + 0.5  # waits for r1 a while
    fleet.free["r1"] = 1
    assert [p for _, p in d.step(fleet, now=0.2).dispatched] == ["r1"]
    # without the wait (the default) it takes the free replica at once
    q.push("f", 0, 1, 1, now=0.0, item="y")
    fleet.free = {"r1": 0, "r2": 1}
    assert [p for _, p in Dispatcher(q).step(fleet, now=0.0).dispatched] == ["r2"]
    # and after the wait, which runs from when it was first held back, not from its arrival:
    # one that reaches the head after longer in line than the wait still waits for its replica
    # (timed from arrival, under a long queue every request would go cache-blind)
    q.push("f", 0, 1, 1, now=0.0, item="z")
    fleet.free = {"r1": 0, "r2": 1}
    step = d.step(fleet, now=0.6)
    assert step.dispatched == [] and step.wake_at == 0.6 + 0.5
    assert [p for _, p in d.step(fleet, now=1.1).dispatched] == ["r2"]


def test_dispatch_expires_first() -> None:
    q = FlowQueue(limits_of(ttl=1.0))
    old = q.push("f", 0, 1, 1, now=0.0)
    new = q.push("f", 0, 1, 1, now=0.5)
    step = Dispatcher(q).step(FakeFleet({"r1": 5}), now=1.2)
    assert step.expired == [old] and [e for e, _ in step.dispatched] == [new]


# -- classification and settings ---------------------------------------------------------
def test_priority_from_objective_key_or_route() -> None:
    key = "ab" * 32
    s = FlowControlSettings(objectives={"chat": 10, "batch": -1}, api_key_priorities={key: 3})
    assert classify(s, {"x-llm-d-inference-objective": "chat"}, "r").priority == 10
    assert classify(s, {"x-gateway-inference-objective": "batch"}, "r").priority == -1  # legacy header
    assert classify(s, {"x-llm-d-inference-objective": "typo"}, "r", key_hash=key).priority == 3
    assert classify(s, {}, "r", route_default=2).priority == 2
    assert classify(s, {}, "r").priority == 0
    assert vllm_priority(10) == "-10"


def test_flow_from_fairness_header_key_or_route() -> None:
    s = FlowControlSettings()
    assert classify(s, {"x-llm-d-inference-fairness-id": "t1"}, "r").flow == "id:t1"
    assert classify(s, {"x-gateway-inference-fairness-id": "t2"}, "r").flow == "id:t2"
    key = "cd" * 32
    flow = classify(s, {}, "r", key_hash=key).flow
    assert flow.startswith("key:") and key not in flow  # never the whole hash, never the key
    assert classify(s, {}, "r").flow == "route:r"
    # what routing reads: the flow a client named, None for an anonymous one
    assert named_flow(s, {"x-llm-d-inference-fairness-id": " t1 "}) == "id:t1"
    assert named_flow(s, {}, key) == flow
    assert named_flow(s, {"x-llm-d-inference-fairness-id": "  "}) is None


def test_the_headers_are_the_clients_word_unless_their_lists_are_emptied() -> None:
    """docs/security.md, "Flow-control headers": by default a keyed client's objective header
    outranks its key's priority and its fairness header names its flow; with both header
    lists emptied the key alone decides."""
    key = "ef" * 32
    headers = {"x-llm-d-inference-objective": "chat", "x-llm-d-inference-fairness-id": "other-tenant"}
    trusting = FlowControlSettings(objectives={"chat": 10}, api_key_priorities={key: -1})
    said = classify(trusting, headers, "r", key_hash=key)
    assert (said.priority, said.flow) == (10, "id:other-tenant")
    locked = FlowControlSettings(
        objectives={"chat": 10}, api_key_priorities={key: -1}, objective_headers=[], fairness_headers=[]
    )
    keyed = classify(locked, headers, "r", key_hash=key)
    assert (keyed.priority, keyed.flow) == (-1, "key:" + key[:16])


def test_each_named_flows_queued_prefill_is_counted_apart_while_it_has_some() -> None:
    """The prefix policy reads how much of a replica's queue is the requesting flow's own."""
    replica = Replica(ReplicaConfig(name="r0", url="http://h:1"), None, HealthSettings())  # type: ignore[arg-type]
    a1 = replica.charge_prefill(500, "id:a")
    a2 = replica.charge_prefill(300, "id:a")
    b = replica.charge_prefill(200, "id:b")
    anonymous = replica.charge_prefill(100)
    assert replica.pending_prefill_tokens == 1100
    assert replica.pending_prefill_by_flow == {"id:a": 800, "id:b": 200}
    assert replica.view().pending_prefill_by_flow == {"id:a": 800, "id:b": 200}
    PolicyRunner.prefill_done(replica, a1)
    PolicyRunner.prefill_done(replica, b)
    PolicyRunner.prefill_done(replica, anonymous)
    assert replica.pending_prefill_by_flow == {"id:a": 300}
    PolicyRunner.prefill_done(replica, a2)
    assert replica.pending_prefill_by_flow == {} and replica.pending_prefill_tokens == 0
    # the runner charges a request's uncached prompt to its flow
    request = RequestView("q", "route", "m", "chat", prompt_tokens_estimate=1000, flow="id:a")
    charged = PolicyRunner.acquire(replica, request, Decision("r0", "ring", {"predicted_cached_tokens": 200}))
    assert replica.pending_prefill_by_flow == {"id:a": 800}
    PolicyRunner.answered(replica, charged)
    assert replica.pending_prefill_by_flow == {}


def test_settings_are_strict() -> None:
    with pytest.raises(ValidationError):
        FlowControlSettings(unknown=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        FlowControlSettings(api_key_priorities={"not-a-hash": 1})
    s = FlowControlSettings(bands={5: {"max_requests": 3, "ttl_s": 2.0}})  # type: ignore[dict-item]
    assert s.band(5) == (3, s.max_bytes_per_band, 2.0)
    assert s.band(0) == (s.max_requests_per_band, s.max_bytes_per_band, s.ttl_s)


def test_the_affinity_wait_ends_exactly_at_its_wake_time() -> None:
    """Woken at ``wake_at`` the head must go, whatever the float rounding of now - enqueued_at."""
    fleet = FakeFleet({"r1": 0, "r2": 10**6}, favourite="r1")
    q = FlowQueue(limits_of(max_requests=100_000, ttl=1e9))
    d = Dispatcher(q, affinity_wait_s=0.5)
    for i in range(2000):
        t = i * 0.0371 + 0.013  # enqueue times whose (t + w) - t rounds below w now and then
        q.push("f", 0, 1, 1, now=t)
        step = d.step(fleet, now=t)
        assert step.dispatched == [] and step.wake_at == t + 0.5
        step = d.step(fleet, now=step.wake_at)
        assert len(step.dispatched) == 1


class PrefixFleet(FakeFleet):
    """Each entry's favourite replica is its item."""

    def preferred(self, entry: Entry) -> str | None:
        return entry.item

    def place(self, entry: Entry, allowed: Collection[str]) -> str | None:
        name = entry.item if entry.item in allowed else sorted(allowed)[0]
        self.free[name] -= 1
        return name


def test_look_past_sends_the_first_entry_whose_prefix_replica_has_room() -> None:
    q = FlowQueue(limits_of())
    head = q.push("a", 0, 10, 1, now=0.0, item="r1")  # r1 is full
    same = q.push("a", 0, 10, 1, now=0.0, item="r2")  # behind the head in its own flow
    other = q.push("b", 0, 10, 1, now=0.1, item="r2")
    fleet = PrefixFleet({"r1": 0, "r2": 1})
    step = Dispatcher(q, lookahead=16).step(fleet, now=1.0)
    assert step.dispatched == [(other, "r2")]  # the fair order decides who is looked at first
    assert q.peek() is head
    fleet.free["r2"] = 1  # one flow alone (a route without fairness headers) is looked past too
    assert Dispatcher(q, lookahead=16).step(fleet, now=1.05).dispatched == [(same, "r2")]
    assert q.peek() is head
    fleet.free["r1"] = 1
    assert Dispatcher(q, lookahead=16).step(fleet, now=1.1).dispatched == [(head, "r1")]
    # the window is the first `lookahead` entries in fair order: one further is not seen
    q3 = FlowQueue(limits_of())
    for _ in range(3):
        q3.push("a", 0, 10, 1, now=0.0, item="r1")
    far = q3.push("a", 0, 10, 1, now=0.0, item="r2")
    assert Dispatcher(q3, lookahead=3).step(PrefixFleet({"r1": 0, "r2": 1}), now=0.0).dispatched[0][0] is not far
    assert Dispatcher(q3, lookahead=4).step(PrefixFleet({"r1": 0, "r2": 1}), now=0.0).dispatched == [(far, "r2")]
    # nobody's favourite has room: the head spills (after affinity_wait_s, here 0)
    q2 = FlowQueue(limits_of())
    lone = q2.push("a", 0, 10, 1, now=0.0, item="r1")
    waiting = Dispatcher(q2, affinity_wait_s=0.5, lookahead=16)
    spill = PrefixFleet({"r1": 0, "r3": 1})
    step = waiting.step(spill, now=0.1)
    assert step.dispatched == [] and step.wake_at == 0.1 + 0.5
    assert waiting.step(spill, now=0.1 + 0.5).dispatched == [(lone, "r3")]
