"""Relocate only what varies: the learner of which detected values change (issue 9, item 1)."""

from __future__ import annotations

from typing import Any

from gateway.prefix.learn import VarianceLearner, shape, suggest_pattern
from gateway.prefix.normalize import Normalizer
from gateway.prefix.settings import LearnSettings, NormalizeSettings

STATIC_SYSTEM = (
    "You are the support bot of ACME. Knowledge cutoff: 2024-06-01. Default model gpt-4o-2024-08-06.\n"
    "Config: {\"ttl\": 1741064767}. Code: `parse('2024-01-15')`. Call 2125551234, office hours 9:00-17:00.\n"
    "Build da39a3ee5e6b4b0d3255bfef95601890afd80709, released March 4, 2025 at 05:06."
)


def chat(system: str, user: str = "Hello?") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def stamped(i: int) -> str:
    return (
        f"Current time: 2025-03-04T05:{i // 60 % 60:02d}:{i % 60:02d}Z. Request req_{i:04d}k9x0a2b.\n" + STATIC_SYSTEM
    )


def test_static_look_alikes_are_never_rewritten_across_100_identical_requests() -> None:
    norm = Normalizer(NormalizeSettings(mode="relocate"))
    body = chat(STATIC_SYSTEM)
    for _ in range(100):
        result = norm.apply("chat", body)
        assert result.body is body and not result.relocated
    rows = norm.tally
    assert sum(r[1] for r in rows.values()) == 0  # nothing moved
    assert sum(r[2] for r in rows.values()) == 100 * sum(1 for k in result.kept if k.status == "static")
    assert {k.status for k in result.kept} == {"static", "protected"}
    assert norm.learner.warmup_misses == 0


def test_a_value_changing_every_request_moves_from_the_second_request_on() -> None:
    norm = Normalizer(NormalizeSettings(mode="relocate"))
    results = [norm.apply("chat", chat(stamped(i))) for i in range(10)]
    assert not results[0].relocated  # first sight: not known to vary (one warm-up miss)
    for r in results[1:]:
        assert {c.rule for c in r.changes} == {"iso_datetime", "prefixed_id"}
        assert "2024-06-01" in r.body["messages"][0]["content"]  # static values stay byte for byte
    stable = {r.body["messages"][0]["content"] for r in results[1:]}
    assert len(stable) == 1  # byte-identical stable prefix from the 2nd request on
    assert norm.learner.warmup_misses == 2  # the first request kept both values in place


def test_a_route_can_force_a_rule() -> None:
    norm = Normalizer(NormalizeSettings(mode="relocate", always=["iso_datetime"]))
    first = norm.apply("chat", chat(stamped(0)))
    assert [c.rule for c in first.changes] == ["iso_datetime"]


def test_report_mode_learns_but_moves_nothing() -> None:
    norm = Normalizer(NormalizeSettings(mode="report"))
    for i in range(3):
        body = chat(stamped(i))
        result = norm.apply("chat", body)
        assert result.body is body
    assert norm.tally["iso_datetime"][:2] == [3, 0]
    assert {(k.rule, k.status) for k in result.kept} >= {("iso_datetime", "varies"), ("date", "static")}


def test_dry_run_records_nothing() -> None:
    norm = Normalizer(NormalizeSettings(mode="relocate"))
    norm.apply("chat", chat(stamped(0)))
    dry = norm.apply("chat", chat(stamped(1)), learn=False)
    assert {c.rule for c in dry.changes} == {"iso_datetime", "prefixed_id"}  # what the next request would do
    assert norm.learner.warmup_misses == 0 and norm.tally["iso_datetime"][0] == 1


def test_memory_is_bounded_and_places_expire() -> None:
    learner = VarianceLearner(max_places=3, expire_s=10)
    now = [0.0]
    learner.clock = lambda: now[0]
    for i in range(10):
        learner.record("date", f"w{i}", "ctx", "v")
    assert len(learner) == 3
    learner.record("date", "w9", "ctx", "v2")
    assert learner.varies("date", "w9", "ctx", "v3")
    now[0] = 100.0
    assert not learner.varies("date", "w9", "ctx", "v3")  # expired: forgotten
    assert not learner.record("date", "w9", "ctx", "v4")


def test_learner_settings_bound_it() -> None:
    norm = Normalizer(NormalizeSettings(mode="relocate", learn=LearnSettings(max_places=2)))
    for i in range(5):
        norm.apply("chat", chat(f"a {i}-03-2025 b 2025-03-0{i + 1} c 17:3{i}"))
    assert len(norm.learner) <= 2


def test_shapes_and_suggested_patterns_hold_no_text() -> None:
    assert shape("req_8f3k2l9x0a") == "aaa_9a9a9a9a9a"
    assert shape("2025年3月4日17:30:00") == "9999年9月9日99:99:99"
    assert shape("Café 12") == "Aaaa 99"
    assert suggest_pattern(shape("req_8f3k2l9x0a")) == "[a-z]{3}_[a-z0-9]{10}"
    assert suggest_pattern("2025年3月4日17:30:00") == r"\d{4}年\d{1,2}月\d{1,2}日\d{1,2}:\d{1,2}:\d{1,2}"


# --- discovery: what no rule knows ---------------------------------------------------------
def unknown(i: int) -> str:
    """A value no detector matches (detectors off): a CJK timestamp, then a request id."""
    return f"现在是2025年3月{i % 28 + 1}日，请求 REQ-{i * 7919 % 100000:05d}-K。\n" + "Be brief. " * 50  # noqa: RUF001


def test_a_span_no_rule_knows_is_learned_by_diffing_successive_requests() -> None:
    norm = Normalizer(NormalizeSettings(mode="relocate", detectors=[]))
    results = [norm.apply("chat", chat(unknown(i))) for i in range(8)]
    assert not results[0].relocated and not results[1].relocated
    assert results[2].counts == {"learned": 2}  # both learned on the 3rd request and applied to it
    assert all(r.counts == {"learned": 2} for r in results[2:])
    assert len({r.body["messages"][0]["content"] for r in results[2:]}) == 1
    rules = norm.discoverer.rules()  # type: ignore[union-attr]
    assert sorted(r.pattern for r in rules) == sorted([r"\d{4}年\d{1,2}月\d{1,2}日", r"[A-Z]{3}\-\d{5}\-[A-Z]{1}"])
    assert all("请求" not in r.example and "REQ" not in r.example for r in rules)  # shapes only


def test_discovery_ignores_words_and_bounds_itself() -> None:
    norm = Normalizer(NormalizeSettings(mode="relocate", detectors=[], learn=LearnSettings(max_discovered=1)))
    for name in ["Alice", "Bob", "Carol", "Dave"]:  # different tenants' names are not values
        norm.apply("chat", chat(f"You help {name} today. " + "Be brief. " * 50))
    assert norm.discoverer.rules() == []  # type: ignore[union-attr]
    for i in range(12):
        norm.apply("chat", chat(unknown(i)))
    assert len(norm.discoverer.rules()) == 1  # type: ignore[union-attr]


def test_discovery_ignores_per_tenant_ids_followed_by_other_text() -> None:
    """``tenant-00`` vs ``tenant-01`` at the same spot of two tenants' system prompts has digits
    and the same text before it, but what follows differs: two templates, not a volatile value
    (found in the agent workloads, where it was relocated out of every tenant's head)."""
    norm = Normalizer(NormalizeSettings(mode="relocate", detectors=[]))
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]
    for i in range(12):
        t = i % 3
        norm.apply("chat", chat(f"You are the agent of tenant-{t:02d}. Follow these. " + f"{words[t]} rules " * 40))
    assert norm.discoverer.rules() == []  # type: ignore[union-attr]


def test_discovered_spans_are_not_moved_inside_json() -> None:
    norm = Normalizer(NormalizeSettings(mode="relocate", detectors=[]))
    results = [norm.apply("chat", chat('cfg {"build": "B' + f"{i:04d}x" + '", "a": 1} ' + "x " * 60)) for i in range(5)]
    assert not any(r.relocated for r in results)
    assert results[-1].kept and results[-1].kept[0].status == "protected"


def test_a_dry_run_predicts_a_discovery_without_storing_it() -> None:
    """Explain's answer for the request that discovers a span equals what the request then gets."""
    norm = Normalizer(NormalizeSettings(mode="relocate", detectors=[]))
    for i in range(2):
        norm.apply("chat", chat(unknown(i)))
    dry = norm.apply("chat", chat(unknown(2)), learn=False)
    assert dry.counts == {"learned": 2} and norm.discoverer.rules() == []  # type: ignore[union-attr]
    real = norm.apply("chat", chat(unknown(2)))
    assert real.body == dry.body and len(norm.discoverer.rules()) == 2  # type: ignore[union-attr]


def test_gateway_processes_share_what_varies_so_the_warm_up_is_paid_once_per_fleet() -> None:
    """Two processes wired as the shared state wires them (gateway.state.affinity_sync): what one
    sees (a place and its first value, then that it varies) the other learns, as digests only."""
    a, b = Normalizer(NormalizeSettings(mode="relocate")), Normalizer(NormalizeSettings(mode="relocate"))
    heard: list[tuple[int, int]] = []

    class Wire:  # a LearnSink, as the shared state's
        def __init__(self, to: Normalizer) -> None:
            self.to = to

        def learned(self, place: int, value: int) -> None:
            heard.append((place, value))
            self.to.learner.learn_peer(place, value)

    a.learner.attach_sink(Wire(b))
    b.learner.attach_sink(Wire(a))
    assert not a.apply("chat", chat(stamped(0))).relocated  # the fleet's first sighting stays in place
    # b's first sighting of the place has another value than a saw there: it varies, moved at once
    first_at_b = b.apply("chat", chat(stamped(1)))
    assert {c.rule for c in first_at_b.changes} == {"iso_datetime", "prefixed_id"}
    assert b.learner.warmup_misses == 0
    # and a process that learns it late (a catch-up snapshot) moves it from its first request
    c = Normalizer(NormalizeSettings(mode="relocate"))
    for place in a.learner.varying_digests(100):
        c.learner.learn_peer(place)
    assert c.apply("chat", chat(stamped(2))).relocated
    assert all(isinstance(p, int) and isinstance(v, int) for p, v in heard)  # no prompt text goes out
    # static look-alikes seen by both with the same values stay static everywhere
    assert not b.apply("chat", chat(STATIC_SYSTEM)).relocated
