"""Fixtures for the doctor tests: fleets of simulated replicas that each test sees fresh (empty
caches, zeroed counters), started once for the package and reset before each test
(``tests/replica_fleet.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.sim.launcher import ReplicaGroup
from tests.replica_fleet import fresh, shared_group

SIM_OPTIONS = {
    "time_scale": 0,
    "enable_admin": True,  # the reset between tests (POST /sim/restart)
    "num_gpu_blocks": 4096,
    "max_output_tokens": 4,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}


@pytest.fixture(scope="package")
def fleet_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaGroup]:
    """Four instant simulated vLLM replicas for ``fleet``."""
    with shared_group(tmp_path_factory, "sims", 4, **SIM_OPTIONS) as group:
        yield group


@pytest.fixture(scope="package")
def fresh_fleet_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaGroup]:
    """Four more, for ``fresh_fleet``."""
    with shared_group(tmp_path_factory, "sims2", 4, **SIM_OPTIONS) as group:
        yield group


@pytest.fixture
def fleet(fleet_processes: ReplicaGroup) -> ReplicaGroup:
    """Four instant simulated vLLM replicas with empty caches, as if just started."""
    return fresh(fleet_processes)


@pytest.fixture
def fresh_fleet(fresh_fleet_processes: ReplicaGroup) -> ReplicaGroup:
    """A second fleet with empty caches, for rerunning the traffic with a fix applied."""
    return fresh(fresh_fleet_processes)


@pytest.fixture(scope="session")
def shared_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaGroup]:
    """Replicas shared by the tests that do not depend on what the caches hold."""
    group = ReplicaGroup(2, log_dir=tmp_path_factory.mktemp("shared-sims"), **SIM_OPTIONS)
    with group.start():
        yield group
