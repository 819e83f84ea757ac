"""Fixtures for the picker's tests: four simulated replicas shared by the package, fresh per test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.sim.launcher import ReplicaGroup
from tests.replica_fleet import fresh, shared_group

SIM_OPTIONS = {
    "tokenizer": "cl100k_base",
    "time_scale": 0,
    "enable_admin": True,
    "num_gpu_blocks": 4096,
    "max_output_tokens": 8,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}


@pytest.fixture(scope="package")
def fleet_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaGroup]:
    with shared_group(tmp_path_factory, "epp-sims", 4, **SIM_OPTIONS) as group:
        yield group


@pytest.fixture
def fleet(fleet_processes: ReplicaGroup) -> ReplicaGroup:
    """Four instant simulated vLLM replicas with empty prefix caches, as if just started."""
    return fresh(fleet_processes)


@pytest.fixture
def echo_url() -> Iterator[str]:
    """The gateway tests' echo upstream: answers with the body and headers it received."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
    from gw_echo import run_echo

    with run_echo() as url:
        yield url
