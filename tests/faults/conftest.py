"""Fixtures for the fault suite: four real simulated replicas (processes) that tests kill,
freeze (SIGSTOP) and misconfigure, restored to a clean state after every test."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import httpx
import pytest

from gateway.sim.launcher import ReplicaGroup

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
    replicas = ReplicaGroup(4, log_dir=tmp_path_factory.mktemp("fault-sims"), **SIM_OPTIONS)
    replicas.start()
    try:
        yield replicas
    finally:
        for replica in replicas.replicas:
            replica.signal(signal.SIGCONT)  # a stopped process ignores SIGTERM until continued
        replicas.stop()


@pytest.fixture
def fleet(group: ReplicaGroup) -> Iterator[ReplicaGroup]:
    """The four replicas, all alive, running and without injected faults — before and after."""
    _restore(group)
    try:
        yield group
    finally:
        _restore(group)


def _restore(group: ReplicaGroup) -> None:
    for replica in group.replicas:
        replica.signal(signal.SIGCONT)
    for index in group.dead():
        group.restart(index)
    group.wait_healthy(30)
    for url in group.urls:
        httpx.post(f"{url}/sim/faults", json={"reset": True}, timeout=10).raise_for_status()
