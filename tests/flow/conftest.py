"""Fixtures: simulated replicas slow enough to saturate (real processes), shared by the flow tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.sim.launcher import run_replicas

sys.path.insert(0, str(Path(__file__).parent.parent / "gateway"))  # gw_helpers, gw_echo

#: real time; decoding 10 ms a token, so a request's length is set by its max_tokens
SLOW_SIM = {
    "time_scale": 1.0,
    "decode_ms_per_token": 10.0,
    "max_output_tokens": 200,
    "prefill_tokens_per_s": 50000.0,
    "enable_admin": True,
    "num_gpu_blocks": 4096,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}


@pytest.fixture(scope="session")
def slow_sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two replicas in real time (see SLOW_SIM)."""
    with run_replicas(2, log_dir=tmp_path_factory.mktemp("flow-sims"), **SLOW_SIM) as urls:
        yield urls
