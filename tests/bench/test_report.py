"""The benchmark report: target verdicts, tables and charts from a results document."""

from __future__ import annotations

from benchmarks.report import charts, evaluate, level_table, render_text


def _run(hit, p50, p90, share=1.0, mm=1.1):
    return {
        "requests": 10,
        "ok": 10,
        "unfinished": 0,
        "hit_rate": hit,
        "ttft_ms": {"p50": p50, "p90": p90, "p99": p90 * 2, "mean": p50},
        "ttft_censored": 0,
        "throughput_rps": 5.0,
        "throughput_tok_s": 5000.0,
        "load": {
            "replicas": ["r0", "r1"],
            "mean_in_flight": {"r0": 1.0, "r1": 2.0},
            "max_over_mean": mm,
            "cv": 0.2,
            "bound_ok_share": share,
            "worst_excess": 0.5,
            "assign_bound_ok_share": share,
            "assign_worst_excess": 0.5,
            "assign_certain_ok_share": share,
            "assign_certain_worst_excess": 0.5,
            "skew_s": 0.02,
        },
    }


def _levels():
    return {
        "moderate": {
            "runs": {"round_robin": _run(0.20, 100, 300), "prefix": _run(0.60, 40, 90)},
            "oracle": _run(0.62, 30, 60),
        },
        "saturated": {
            "runs": {"round_robin": _run(0.20, 1000, 5000), "prefix": _run(0.55, 300, 900, share=0.9)},
            "oracle": _run(0.62, 30, 60),
        },
    }


def test_verdicts_apply_each_target_where_it_belongs():
    verdicts = {(v.level, v.target): v for v in evaluate("w", _levels(), control=False)}
    assert verdicts[("moderate", "hit rate >= 95% of oracle")].passed is True  # 0.60 / 0.62 = 97 %
    assert verdicts[("saturated", "hit rate >= 95% of oracle")].passed is False  # 0.55 / 0.62 = 89 %
    assert verdicts[("moderate", "TTFT p50 <= 1/2 of round_robin")].passed is True  # 0.4x
    assert verdicts[("saturated", "TTFT p90 <= 1/10 of round_robin")].passed is False  # 0.18x
    assert verdicts[("moderate", "max in-flight <= 1.25 x mean + 1")].passed is True
    assert verdicts[("saturated", "max in-flight <= 1.25 x mean + 1")].passed is False
    assert verdicts[("saturated", "TTFT p90 <= 1/10 of round_robin")].value == 900 / 5000


def test_control_compares_with_least_loaded_and_skips_hit_rate():
    levels = {"moderate": {"runs": {"least_loaded": _run(0, 100, 200), "prefix": _run(0, 104, 230)}}}
    verdicts = {v.target: v for v in evaluate("control", levels, control=True)}
    assert verdicts["TTFT p50 within 5% of least_loaded"].passed is True
    assert verdicts["TTFT p90 within 5% of least_loaded"].passed is False
    assert verdicts["hit rate >= 95% of oracle"].passed is None


def test_missing_candidate_is_reported_not_failed():
    levels = {"moderate": {"runs": {"round_robin": _run(0.2, 100, 300)}}}
    (verdict,) = evaluate("w", levels, control=False)
    assert verdict.passed is None and "prefix" in verdict.detail


def test_table_has_every_policy_and_the_oracle_with_ratios():
    table = level_table(_levels()["moderate"])
    lines = table.splitlines()
    assert lines[0].startswith("| policy")
    assert any(line.startswith("| prefix ") and "0.40x" in line for line in lines)  # p50 vs round-robin
    assert any(line.startswith("| oracle (pooled)") for line in lines)
    assert "96.8%" in table  # prefix hit rate as a share of the oracle


def test_render_text_and_charts(tmp_path):
    results = {
        "meta": {"mode": "test"},
        "missing_policies": ["session"],
        "workloads": {"w": {"summary": {"requests": 10}, "levels": _levels(), "targets": []}},
    }
    text = render_text(results)
    assert "## w" in text and "session" in text
    paths = charts(results, tmp_path)
    assert [p.name for p in paths] == ["policies_hit_rate.png", "policies_ttft.png", "policies_load.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_policy_that_failed_to_start_is_shown_not_crashed():
    levels = {"moderate": {"runs": {"round_robin": _run(0.2, 100, 300), "prefix": {"error": "boom"}}}}
    assert "failed to start" in level_table(levels["moderate"])
    (verdict,) = evaluate("w", levels, control=False)
    assert verdict.passed is None and "failed to start" in verdict.detail
