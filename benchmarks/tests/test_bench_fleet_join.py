"""bench_fleet's join mode: the window statistics (pure), and a smoke run of the mode itself
(2 gateways sharing a real Redis, a 3rd joining mid-run, on a small sample)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_fleet
from benchmarks.joiner import Joiner, hit_rate_se, join_window
from benchmarks.replay import Outcome

A, B, NEW = "http://a", "http://b", "http://new"


def outcome(sent: float, url: str, cached: int, prompt: int = 100) -> Outcome:
    return Outcome(
        0, sent, sent=sent, first_token=sent + 0.01, done=sent + 0.02, status=200, replica="r0", sent_to=url,
        prompt_tokens=prompt, cached_tokens=cached,
    )  # fmt: skip


def test_join_window_compares_the_joiner_with_the_others_from_its_first_request() -> None:
    before = [outcome(t / 10, A if t % 2 else B, 0) for t in range(10)]  # before the join: not counted
    after = []
    for i in range(30):
        t = 1.0 + i / 10
        after.append(outcome(t, (A, B, NEW)[i % 3], 50 if i % 3 == 2 else 90))
    window = join_window(before + after, NEW, window_s=2.0, run_end_s=10.0)
    assert window["window"]["start_s"] == pytest.approx(1.2)  # the joiner's first request
    assert window["window"]["end_s"] == pytest.approx(3.2) and not window["window"]["cut_by_end_of_run"]
    assert window["joiner"]["requests"] == 7 and window["joiner"]["hit_rate"] == pytest.approx(0.5)
    assert window["others"]["requests"] == 13 and window["others"]["hit_rate"] == pytest.approx(0.9)
    assert window["gap_points"] == pytest.approx(40.0)
    assert window["gap_se_points"] == pytest.approx(0.0)  # every request alike: no sampling noise

    cut = join_window(before + after, NEW, window_s=60.0, run_end_s=3.9, after_s=2.0)
    assert cut["window"]["cut_by_end_of_run"] and cut["joiner"]["requests"] == 10
    assert cut["after_snapshot"]["joiner"]["requests"] == 7  # the joiner's requests from 2.0 s on (2.1 ... 3.9)

    assert join_window(before, NEW, 2.0, 10.0)["gap_points"] is None  # it served nothing


def test_hit_rate_se_grows_with_heterogeneous_requests() -> None:
    alike = [outcome(i, A, 50) for i in range(40)]
    mixed = [outcome(i, A, 0 if i % 2 else 100) for i in range(40)]
    assert hit_rate_se(alike) == pytest.approx(0.0)
    assert 0.05 < hit_rate_se(mixed) < 0.12  # ~ sqrt(0.25 / 40)
    assert hit_rate_se(mixed[:1]) is None


def test_the_snapshot_lands_when_half_of_the_smallest_one_is_applied() -> None:
    joiner = Joiner(lambda: None, 0.0, "key", peers_records_at_launch=[50, 60])
    joiner.applied = [(5.0, 3), (5.1, 8), (5.2, 12), (5.3, 300), (5.4, 620)]
    assert joiner.records_since_launch([350, 360]) == [300, 300]
    assert joiner.snapshot_landed_s([350, 360]) == 5.3
    assert joiner.snapshot_landed_s([50, 60]) is None  # catch-up off: nothing sent since it started


@pytest.mark.slow
def test_join_mode_runs_end_to_end(redis_url: str, tmp_path: Path) -> None:
    # ~14 s of arrivals; the 3rd gateway starts 5.5 s after the peers were ready (each sends at
    # most one snapshot per 5 s, and they sent one to each other when they met)
    out = tmp_path / "fleet.json"
    # agent: built from code, no trace file (a fresh clone has no ../shared/workloads)
    argv = ["--mode", "join", "--workload", "agent", "--join-size", "2.5", "--join-at", "0.3"]
    assert bench_fleet.main([*argv, "--redis-url", redis_url, "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    wl = results["workloads"]["agent"]
    assert "rows" not in wl  # join mode only: the 1-vs-3 rows did not run
    for row in bench_fleet.JOIN_ROWS:
        r = wl["join"]["rows"][row]
        assert r["errors"] == 0 and r["join"]["error"] is None
        assert r["join"]["launched_s"] < r["join"]["ready_s"] < wl["join"]["span_s"]
        assert r["joiner"]["requests"] > 0 and r["others"]["requests"] > r["joiner"]["requests"]
    caught_up, blind = (wl["join"]["rows"][row]["join"] for row in bench_fleet.JOIN_ROWS)
    assert sum(caught_up["peers_snapshot_records"]) > 0  # the peers sent the joiner a snapshot...
    assert sum(blind["peers_snapshot_records"]) == 0  # ...and nothing with catch_up_keys: 0
    # it was ready only once caught up: by then it had applied (at least half of) the snapshot
    assert caught_up["applied_at_ready"] >= min(caught_up["peers_snapshot_records"]) / 2
    verdict = wl["verdict"]
    for key in ("join_gap_points", "join_gap_se_points", "join_blind_gap_points", "join_decided"):
        assert key in verdict
    # the warm control got the joiner's requests on a gateway that knew everything from the start
    control = wl["join"]["rows"][bench_fleet.WARM_ROW]
    assert control["errors"] == 0 and control["joiner"]["requests"] > 0
    assert verdict["join_control_gap_points"] == control["gap_points"]
    with_catch_up = wl["join"]["rows"][bench_fleet.JOIN_ROWS[0]]
    assert verdict["join_excess_gap_points"] == round(with_catch_up["gap_points"] - control["gap_points"], 2)
    assert set(verdict["pass"]) == {"join"}
    assert results["targets"]["join_gap_points"] == 2.0


def test_the_fleets_prediction_pools_every_gateways_tokens() -> None:
    """Three pods' predictions weigh by the prompt tokens each predicted, not one vote each; a
    pod that answered nothing (or whose stats could not be read) adds nothing."""
    stats = [
        {"predicted_cached_tokens": 500, "predicted_prompt_tokens": 1_000},
        {"predicted_cached_tokens": 0, "predicted_prompt_tokens": 3_000},
        {"predicted_cached_tokens": None, "predicted_prompt_tokens": 0},
        None,
    ]
    assert bench_fleet.pooled_prediction(stats) == 500 / 4_000
    assert bench_fleet.pooled_prediction([None]) is None
