"""Fixtures for the prefix-routing end-to-end tests: a fresh fleet of 4 simulated replicas per test.

A fresh fleet (about a second to start at ``time_scale=0``) keeps every test's cache
assertions independent of the others; the echo upstream is the gateway tests' own.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import SIM_OPTIONS

from gateway.sim.launcher import ReplicaGroup

# Reuse the gateway tests' echo upstream (a real server that answers with what it received).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[ReplicaGroup]:
    """Four instant simulated vLLM replicas with empty prefix caches (stopped after the test)."""
    group = ReplicaGroup(4, log_dir=tmp_path / "sims", **SIM_OPTIONS)
    with group.start():
        yield group


@pytest.fixture
def echo_url() -> Iterator[str]:
    from gw_echo import run_echo

    with run_echo() as url:
        yield url
