"""Fixtures for the prefix-routing end-to-end tests: a fleet of 4 simulated replicas that every
test sees fresh (empty prefix caches, zeroed counters, no faults).

The processes are started once for the package and reset before each test through the
simulator's admin API (``tests/replica_fleet.py``), which keeps every test's cache assertions
independent of the others without paying a fleet start per test; the echo upstream is the
gateway tests' own.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import SIM_OPTIONS

from gateway.sim.launcher import ReplicaGroup
from tests.replica_fleet import fresh, shared_group

# Reuse the gateway tests' echo upstream (a real server that answers with what it received).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))


@pytest.fixture(scope="package")
def fleet_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaGroup]:
    """Four instant simulated vLLM replicas, shared by the package's tests (use ``fleet``)."""
    with shared_group(tmp_path_factory, "sims", 4, **SIM_OPTIONS) as group:
        yield group


@pytest.fixture
def fleet(fleet_processes: ReplicaGroup) -> ReplicaGroup:
    """Four instant simulated vLLM replicas with empty prefix caches, as if just started."""
    return fresh(fleet_processes)


@pytest.fixture
def echo_url() -> Iterator[str]:
    from gw_echo import run_echo

    with run_echo() as url:
        yield url
