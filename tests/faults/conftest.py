"""Fixtures for the fault suite: four real simulated replicas (processes) that tests kill,
freeze (SIGSTOP) and misconfigure, restored to a clean state after every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.sim.launcher import ReplicaGroup
from tests.replica_fleet import restore, shared_group

# Streams take a few hundred ms (decode steps are real time), so that some are always in
# flight when a fault strikes; prefill is instant.
SIM_OPTIONS = {
    "time_scale": 1.0,
    "decode_ms_per_token": 10,
    "prefill_tokens_per_s": 1_000_000,
    "enable_admin": True,
    "num_gpu_blocks": 4096,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/faults/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.faults)


@pytest.fixture(scope="package")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaGroup]:
    with shared_group(tmp_path_factory, "fault-sims", 4, **SIM_OPTIONS) as group:
        yield group


@pytest.fixture
def fleet(group: ReplicaGroup) -> Iterator[ReplicaGroup]:
    """The four replicas, all alive, running and without injected faults — before and after."""
    restore(group)
    try:
        yield group
    finally:
        restore(group)
