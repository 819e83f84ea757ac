"""Fixtures for the picker's tests: four simulated replicas shared by the package, fresh per test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.sim.launcher import ReplicaGroup
from tests.e2e_prefix.e2e_helpers import SIM_OPTIONS  # the prefix e2e tests' fleet: same tokenizer, instant
from tests.replica_fleet import fresh, shared_group


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
