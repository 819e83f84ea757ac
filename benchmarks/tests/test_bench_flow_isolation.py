"""The isolation benchmark's arithmetic: each run's ratios first, then the medians over runs."""

from __future__ import annotations

from benchmarks import bench_flow_isolation as bfi


def cell(idle: float, quiet: float, high: float, done: int) -> dict[str, float]:
    return {"idle_p90_ms": idle, "quiet_p90_ms": quiet, "high_p90_ms": high, "flood_done": done, "held": 1}


def test_ratios_are_taken_within_a_run_then_the_median_over_runs() -> None:
    runs = {
        "off": [cell(70, 4000, 4000, 72), cell(70, 4000, 4000, 70), cell(70, 4000, 4000, 60)],
        "held": [cell(70, 210, 220, 66), cell(100, 200, 200, 63), cell(70, 280, 140, 60)],
    }
    summary = bfi.summarize(runs)
    held = summary["held"]
    assert held["quiet_x_idle"] == 3.0  # per run 210/70, 200/100, 280/70
    # per run 220/70 = 3.14, 200/100, 140/70: 2.0 — not the medians' 200/70 = 2.86 (each run's
    # idle p90 divides its own flood: a slow moment of the machine weighs on both)
    assert held["high_x_idle"] == 2.0
    assert held["flood_x_off"] == 66 / 72  # per run against off's same run: 66/72, 63/70, 60/60
    assert summary["off"]["flood_x_off"] == 1.0
    table = bfi.table(summary)
    assert "| held | 70 | 210 (3.00) | 200 (2.00) | 63 (0.92) | 1 |" in table


def test_the_free_seat_row_leaves_one_engine_sequence_free() -> None:
    assert bfi.ROWS["free seat"]["saturation"]["in_flight"] == bfi.SIM["max_num_seqs"] - 1
    assert bfi.ROWS["held"]["saturation"]["in_flight"] == bfi.SIM["max_num_seqs"]
    assert bfi.ROWS["off"] == {"enabled": False}
