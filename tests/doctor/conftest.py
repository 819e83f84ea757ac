"""Fixtures for the doctor tests: a fresh fleet of simulated replicas per test (empty caches)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.sim.launcher import ReplicaGroup

SIM_OPTIONS = {
    "time_scale": 0,
    "num_gpu_blocks": 4096,
    "max_output_tokens": 4,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[ReplicaGroup]:
    """Four instant simulated vLLM replicas (stopped after the test)."""
    group = ReplicaGroup(4, log_dir=tmp_path / "sims", **SIM_OPTIONS)
    with group.start():
        yield group


@pytest.fixture
def fresh_fleet(tmp_path: Path) -> Iterator[ReplicaGroup]:
    """A second fleet with empty caches, for rerunning the traffic with a fix applied."""
    group = ReplicaGroup(4, log_dir=tmp_path / "sims2", **SIM_OPTIONS)
    with group.start():
        yield group


@pytest.fixture(scope="session")
def shared_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaGroup]:
    """Replicas shared by the tests that do not depend on what the caches hold."""
    group = ReplicaGroup(2, log_dir=tmp_path_factory.mktemp("shared-sims"), **SIM_OPTIONS)
    with group.start():
        yield group
