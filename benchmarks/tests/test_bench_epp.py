"""bench_epp: its verdict and table from a made-up run, and a tiny live run of its Envoy + picker row.

The live test starts a simulated replica, ``prefix-gateway epp`` and a real Envoy exactly as the
benchmark does and sends a few closed-loop requests; it is skipped only where the envoy binary
or the [epp] extra is missing.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from benchmarks.bench_epp import (
    ROW,
    envoy_process,
    picker_config,
    picker_process,
    table,
    unavailable_reason,
    verdict,
)
from benchmarks.bench_workers import peak
from gateway.sim.launcher import run_replicas


def made_up(picker_rps: float, added_ms: float) -> dict:
    row = {"p50_ms": 1.0, "p99_ms": 2.0, "errors": 0}
    added = {"rate": 300.0, "added_p50_ms": added_ms, "added_p99_ms": 3.0, "rounds": 3, "errors": 0}
    return {
        "concurrency": 8,
        "peak_rounds": 3,
        "duration_s": 1.0,
        "envoy_concurrency": 2,
        "peak": {
            "direct": {**row, "rps": 3000.0},
            ROW: {**row, "rps": picker_rps},
            "gateway x2": {**row, "rps": 800.0},
            "sglang-router": {**row, "rps": 1600.0},
        },
        "added_latency": {ROW: added},
        "cpu_us_per_request": {ROW: {"picker": 300.0, "envoy": 100.0}},
    }


def test_the_verdict_holds_the_run_to_both_targets() -> None:
    assert verdict(made_up(1700.0, 1.2))["met"] is True
    assert verdict(made_up(1500.0, 1.2))["met"] is False  # below the router's req/s
    assert verdict(made_up(1700.0, 1.6))["met"] is False  # too much added latency
    summary = verdict(made_up(1600.0, 1.0))
    assert summary["picker_vs_router"] == 1.0 and summary["picker_vs_gateway_x2"] == 2.0
    results = made_up(1600.0, 1.0)
    results["verdict"] = summary
    text = table(results)
    assert f"{ROW:<16}" in text and "1.00x" in text and "picker 300 us" in text


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"bench_epp cannot run here: {unavailable_reason()}")
def test_requests_through_envoy_and_the_picker_reach_the_replica(tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        (direct,) = stack.enter_context(
            run_replicas(1, time_scale=0, disable_uvicorn_access_log=True, disable_log_stats=True, log_dir=tmp_path)
        )
        picker = stack.enter_context(picker_process(picker_config(direct), tmp_path))
        url, _ = stack.enter_context(envoy_process([direct], picker.grpc_port, tmp_path, 1))
        row = peak(url, 4, 0.5)
    # fail-closed Envoy: a request the picker did not route would be an error here
    assert row["errors"] == 0 and row["rps"] > 0
