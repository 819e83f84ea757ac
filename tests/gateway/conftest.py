"""Fixtures: real simulated vLLM replicas (separate processes), shared so the suite stays fast."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gw_helpers import reset_faults

from gateway.sim.launcher import run_replicas

SIM_OPTIONS = {
    "time_scale": 0,
    "enable_admin": True,
    "num_gpu_blocks": 4096,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}


@pytest.fixture(scope="session")
def sim_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Four instant replicas (time_scale 0) with fault injection enabled."""
    with run_replicas(4, log_dir=tmp_path_factory.mktemp("sims"), **SIM_OPTIONS) as urls:
        yield urls


@pytest.fixture
def sims(sim_urls: list[str]) -> Iterator[list[str]]:
    """The shared replicas, with every injected fault reset after the test."""
    yield sim_urls
    reset_faults(sim_urls)


@pytest.fixture(scope="session")
def echo_url() -> Iterator[str]:
    """A tiny upstream that answers chat completions with the body and headers it received."""
    from gw_echo import run_echo

    with run_echo() as url:
        yield url
