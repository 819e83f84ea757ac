"""Doctor's parts without a fleet: the replay's hit counting, the template diff and its rules, and
the analyses that read live stats (tokenizer misalignment, KV pressure, spills, spans the gateway
learned, user input before shared text)."""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from random import Random
from typing import Any

import pytest

from gateway.doctor import diagnose, render_text, to_dict
from gateway.doctor.model import Corpus, Part, RouteInfo, Sample
from gateway.doctor.replay import Request, replay
from gateway.doctor.spans import diff_spans, find_spans, suggest_pattern


# -- replay ------------------------------------------------------------------------------------
def test_replay_counts_hits_like_vllm() -> None:
    first = Request(None, [1, 2, 3], 48, 16)
    again = Request(None, [1, 2, 3], 48, 16)  # fully cached: the last block is recomputed (last token)
    longer = Request(None, [1, 2, 3, 4], 70, 16)
    result = replay([first, again, longer])
    assert result.cached_tokens == 0 + 32 + 48 and result.prompt_tokens == 48 + 48 + 70
    # a salt is its own namespace: the same chain under another salt misses
    assert replay([first, Request("tenant", [1, 2, 3], 48, 16)]).cached_tokens == 0
    # an LRU of 3 blocks forgets the first chain once another one passed through
    other = Request(None, [7, 8, 9], 48, 16)
    assert replay([first, other, again], capacity_blocks=3).cached_tokens == 0
    assert replay([first, other, again], capacity_blocks=6).cached_tokens == 32


# -- spans -------------------------------------------------------------------------------------
def _ids(rng: Random, n: int) -> list[str]:
    return ["req_" + "".join(rng.choices(string.ascii_lowercase + string.digits, k=10)) for _ in range(n)]


TEMPLATE = "You are the billing assistant. Session {} is open. Follow the refund rules below exactly, always."


def test_diff_finds_an_unknown_id_and_suggests_a_rule_that_matches_it() -> None:
    texts = [TEMPLATE.format(v) for v in _ids(Random(1), 6)]
    (span,) = find_spans({"messages[0]": texts})
    assert span.where == "messages[0]" and span.changes == 5 and span.left.endswith("Session ")
    assert span.pattern == "req_[0-9a-z]{10}"
    for value in _ids(Random(2), 20):  # values never seen still match
        assert re.fullmatch(span.pattern, value)
    assert not re.search(span.pattern, TEMPLATE)
    assert span.example_shape.startswith("aaa_")


def test_diff_anchors_a_pattern_without_a_literal_prefix_on_the_text_before_it() -> None:
    texts = [
        f"现在时间{h}:{m:02d}\uff0c请简短回答用户的问题。你是客服助理\uff0c遵守下面的退款规则和礼貌要求。"
        for h, m in [(9, 1), (10, 2), (11, 3)]
    ]
    spans = find_spans({"messages[0]": texts})
    assert spans, "a CJK time that changes must be found"
    for span in spans:
        assert span.pattern.startswith("(?<=")
        assert all(re.search(span.pattern, t) for t in texts)


def test_diff_ignores_long_rewrites_trailing_text_and_single_changes() -> None:
    shared = " Then follow the shared instructions of the company handbook, chapter one to nine."
    assert diff_spans("A" * 200 + shared, "B" * 200 + shared) == []  # too long to be a value
    assert diff_spans("Rules here. " * 5 + "Question: hi", "Rules here. " * 5 + "Question: yo") == []  # at the end
    texts = [TEMPLATE.format("req_aaaaaaaaaa"), TEMPLATE.format("req_bbbbbbbbbb")]
    assert find_spans({"messages[0]": texts}) == []  # one change is not yet a pattern (min_changes=2)


def test_suggested_patterns_are_valid_rules() -> None:
    from gateway.prefix.settings import RegexRule

    for left, values in [
        ("id=", ["Zx81kQ0pLmN3vB7cX9qW2e", "Ab12Cd34Ef56Gh78Ij90Kl"]),
        ("at ", ["17:30", "9:05"]),
        ("nonce: ", ["a-b_c", "d+e.f"]),
    ]:
        pattern = suggest_pattern(left, values)
        RegexRule(name="learned_1", pattern=pattern)  # compiles, never matches ""
        assert all(re.search(pattern, left + v) for v in values)


# -- analyses on live stats --------------------------------------------------------------------
def _stats(**route: Any) -> dict[str, Any]:
    replicas = route.pop("engines", {})
    return {
        "routes": {
            "main": {"policy": "prefix", "normalize": "relocate", "replicas": {n: {} for n in replicas}, **route}
        },
        "replicas": {name: {"engine": engine} for name, engine in replicas.items()},
    }


def _causes(corpus: Corpus) -> dict[str, dict[str, Any]]:
    return {f["cause"]: f for f in to_dict(diagnose(corpus))["findings"]}


def test_tokenizer_misalignment_from_predicted_vs_reported() -> None:
    stats = _stats(
        predicted_units="approximate (cl100k_base)",
        predicted_exact=False,
        hit_rate_predicted=0.82,
        hit_rate_reported=0.31,
        predicted_requests=400,
        requests=400,
        engines={"r0": {"block_size": 32, "kv_cache_usage": 0.4}},
    )
    found = _causes(Corpus("test", stats=stats, routes={"main": RouteInfo("main", "relocate", 16)}))
    mismatch = found["tokenizer_mismatch"]
    assert mismatch["data"]["gap"] == pytest.approx(0.51)
    assert mismatch["fix"]["patch"]["prefix"]["block_size"] == 32
    assert "tokenizer:" in mismatch["fix"]["yaml"]
    assert any("block size [32]" in line for line in mismatch["evidence"])
    assert any("approximate (cl100k_base)" in line for line in mismatch["evidence"])
    healthy = _stats(hit_rate_predicted=0.8, hit_rate_reported=0.78, predicted_requests=400)
    assert "tokenizer_mismatch" not in _causes(Corpus("test", stats=healthy))


def test_replicas_that_disagree_are_named_and_those_the_route_cannot_key_are_singled_out() -> None:
    def finding(engines: dict[str, int], hashed: int) -> dict[str, Any]:
        block = {"size": hashed, "setting": "auto", "engines": engines}
        stats = _stats(block_size=block, engines={n: {"block_size": b} for n, b in engines.items()})
        return _causes(Corpus("test", stats=stats))["tokenizer_mismatch"]

    # 16 and 128: the route hashes 16, each 128-token block is keyed as eight of its keys
    keyed = finding({"r0": 16, "r1": 128}, 16)
    assert any("which each engine's is a multiple of" in line for line in keyed["evidence"]), keyed["evidence"]
    # 24 beside 32s: the route hashes 32, and the replica at 24 is only modelled
    modelled = finding({"r0": 24, "r1": 32, "r2": 32}, 32)
    assert any("replicas at [24] are routed by the approximate model" in line for line in modelled["evidence"])
    assert modelled["severity"] > keyed["severity"] > 0


def test_the_route_line_names_the_prediction_error_where_the_hit_rates_hide_it() -> None:
    stats = _stats(hit_rate_predicted=0.5, hit_rate_reported=0.5, predicted_requests=40, prediction_error=0.083)
    diagnosis = diagnose(Corpus("test", stats=stats))
    assert to_dict(diagnosis)["routes"][0]["prediction_error"] == 0.083
    assert "predicted 50.0 % (prediction error 8.3 % of prompt tokens)" in render_text(diagnosis)
    exact = _stats(hit_rate_predicted=0.5, hit_rate_reported=0.5, predicted_requests=40, prediction_error=0.0)
    assert "prediction error" not in render_text(diagnose(Corpus("test", stats=exact)))


def _sample(i: int, cached: int, prompt: int = 1000) -> Sample:
    return Sample(
        "main", "chat", "m", None, [Part("messages[0]", "system", 10, "s")], 16, [i], prompt, cached_tokens=cached
    )


def test_kv_pressure_with_a_falling_hit_rate() -> None:
    stats = _stats(
        hit_rate_predicted=0.9,
        hit_rate_reported=0.5,
        predicted_requests=40,
        engines={
            "r0": {"kv_cache_usage": 0.98, "num_gpu_blocks": 1000, "block_size": 16},
            "r1": {"kv_cache_usage": 0.5},
        },
    )
    samples = [_sample(i, 800 if i < 20 else 200) for i in range(40)]
    found = _causes(Corpus("test", samples=samples, stats=stats, routes={"main": RouteInfo("main", "relocate")}))
    kv = found["kv_pressure"]
    assert kv["data"] == {"kv_cache_usage": {"r0": 0.98}, "falling": True}
    assert kv["fix"]["patch"]["policy_settings"] == {"replica_cache_tokens": "auto"}
    assert "hit rate is falling" in kv["title"]


def test_spills_from_imbalance() -> None:
    stats = _stats(reasons={"affinity": 60, "ring": 10, "spill": 30}, requests=100)
    spill = _causes(Corpus("test", stats=stats))["imbalance_spill"]
    assert spill["data"]["share"] == 0.3 and "load_factor" in spill["fix"]["yaml"]
    calm = _stats(reasons={"affinity": 95, "spill": 5}, requests=100)
    assert "imbalance_spill" not in _causes(Corpus("test", stats=calm))


def test_spans_the_gateway_learned_become_rules() -> None:
    normalization = {
        "mode": "relocate",
        "rules": {"iso_datetime": {"found": 10, "moved": 10, "static": 0}},
        "learned": [
            {
                "where": "messages[0].content",
                "example": "aaa_9a9aaa9aa9",
                "seen": 12,
                "changes": 11,
                "suggested_rule": {"name": "learned_req", "pattern": "req_[0-9a-z]{10}"},
            },
        ],
        "static": [],
        "warmup_misses": 2,
    }
    learned = _causes(Corpus("test", stats=_stats(normalization=normalization)))["learned_span"]
    assert learned["fix"]["patch"]["normalize"]["rules"] == [{"name": "learned_req", "pattern": "req_[0-9a-z]{10}"}]
    assert "messages[0].content" in learned["evidence"][0]
    # a missing or odd normalization section is no error
    assert "learned_span" not in _causes(Corpus("test", stats=_stats(normalization={"learned": "?"})))


def test_user_input_before_shared_instructions() -> None:
    samples = []
    for i in range(10):
        parts = [Part("messages[0]", "user", 40, f"q{i}"), Part("messages[1]", "system", 4000, "shared")]
        samples.append(Sample("main", "chat", "m", None, parts, 16, [i * 100 + b for b in range(60)], 1010))
    corpus = Corpus("test", samples=samples, routes={"main": RouteInfo("main", "relocate")})
    first = _causes(corpus)["user_first"]
    assert first["data"]["where"] == "messages[0]" and first["data"]["shared"] == "messages[1]"
    assert first["gain"] > 0.5
    text = render_text(diagnose(corpus))
    assert "put the shared system text first" in text


def test_mode_off_still_names_the_spans_relocation_would_move() -> None:
    samples = [
        Sample(
            "main",
            "chat",
            "m",
            None,
            [Part("messages[0]", "system", 3000, f"s{i}")],
            16,
            [f"now{i}-{b}" for b in range(50)],
            800,
            keys_relocated=[f"stable-{b}" for b in range(50)],
            tokens_relocated=820,
            spans=[("messages[0].content", "iso_datetime")],
        )
        for i in range(8)
    ]
    corpus = Corpus("test", samples=samples, routes={"main": RouteInfo("main", "off")})
    volatile = _causes(corpus)["volatile_span"]
    assert volatile["data"]["rules"] == {"iso_datetime": 8}
    assert volatile["hit_rate_now"] == 0 and volatile["hit_rate_if_fixed"] > 0.8


def test_stats_alone_name_unrelocated_spans_and_warmup_misses() -> None:
    report_mode = {
        "mode": "report",
        "rules": {"iso_datetime": {"found": 40, "moved": 0, "static": 0}, "uuid": {"found": 0, "moved": 0}},
        "learned": [],
        "warmup_misses": 0,
    }
    stats = _stats(normalize="report", requests=40, normalization=report_mode)
    volatile = _causes(Corpus("test", stats=stats, routes={"main": RouteInfo("main", "report")}))["volatile_span"]
    assert volatile["data"]["rules"] == {"iso_datetime": 40}
    assert volatile["fix"]["patch"] == {"route": "main", "normalize": {"mode": "relocate"}}

    relocating = {
        "mode": "relocate",
        "rules": {"iso_datetime": {"found": 100, "moved": 90, "static": 0}},
        "learned": [],
        "warmup_misses": 10,
    }
    stats = _stats(requests=100, normalization=relocating)
    warmup = _causes(Corpus("test", stats=stats, routes={"main": RouteInfo("main", "relocate")}))["warmup_miss"]
    assert warmup["data"] == {"warmup_misses": 10, "share": 0.1}
    assert warmup["fix"]["patch"] == {"route": "main", "normalize": {"always": ["iso_datetime"]}}
    # in report mode nothing moves: the volatile-span finding covers it, not a warm-up
    stats = _stats(normalize="report", requests=100, normalization={**relocating, "mode": "report"})
    assert "warmup_miss" not in _causes(Corpus("test", stats=stats, routes={"main": RouteInfo("main", "report")}))


def test_user_input_before_shared_instructions_in_a_file(tmp_path: Path) -> None:
    from gateway.doctor.sources import from_jsonl
    from tests.configs import gateway_config

    shared = "You are the travel desk. " + "Follow the booking rules in section {} carefully. " * 40
    lines = [
        json.dumps({"model": "m", "messages": [{"role": "user", "content": q}, {"role": "system", "content": shared}]})
        for q in ("Book Oslo.", "Cancel my trip to Rome please.", "Any seats to Lima?", "Refund for Kyoto?")
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    config = gateway_config(["http://127.0.0.1:9"], routes=[{"name": "main", "policy": "prefix"}])
    found = _causes(from_jsonl(path, config))
    first = found["user_first"]
    assert (first["data"]["where"], first["data"]["shared"]) == ("messages[0]", "messages[1]")
    assert first["data"]["estimated_tokens"] >= 400 and first["gain"] > 0.5


def test_a_failing_engine_scrape_is_named_with_its_error_and_age() -> None:
    stats = _stats(requests=100, engines={"r0": {"age_s": 412.0, "kv_cache_usage": 0.1}, "r1": {}})
    stats["replicas"]["r0"]["engine_error"] = "HTTP 404"
    found = _causes(Corpus("test", stats=stats))["scrape_failing"]
    assert found["route"] == "main" and found["data"]["replicas"] == ["r0"]
    assert "r0: HTTP 404 (last good scrape 412 s ago)" in found["evidence"]
    assert "/metrics" in found["fix"]["summary"]
    healthy = _stats(requests=100, engines={"r0": {"age_s": 1.0}})
    assert "scrape_failing" not in _causes(Corpus("test", stats=healthy))


def test_a_saturated_route_is_named() -> None:
    flow = {"saturated": True, "held": 12, "shed": 3, "expired": 1, "saturated_for_s": 4.5, "bands": {}}
    found = _causes(Corpus("test", stats=_stats(flow_control=flow, requests=100)))["saturated"]
    assert found["route"] == "main" and "saturated" in found["title"] and "4.5 s" in found["title"]
    assert found["data"] == {"held": 12, "shed": 3, "expired": 1}
    idle = {"saturated": False, "held": 0, "shed": 0, "expired": 0, "saturated_for_s": None, "bands": {}}
    assert "saturated" not in _causes(Corpus("test", stats=_stats(flow_control=idle, requests=100)))
    assert "saturated" not in _causes(Corpus("test", stats=_stats(requests=100)))  # flow control never saw it
