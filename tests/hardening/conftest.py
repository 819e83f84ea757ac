"""Fixtures for the hardening tests: a scripted upstream and one simulated replica."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gateway.sim.launcher import run_replicas
from tests.hardening.hostile_upstream import run_upstream


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The scripted upstream (no API key) and the requests it saw."""
    with run_upstream() as pair:
        yield pair


@pytest.fixture(scope="module")
def sim_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One instant simulated vLLM replica."""
    options = {"time_scale": 0, "disable_uvicorn_access_log": True, "disable_log_stats": True}
    with run_replicas(1, log_dir=tmp_path_factory.mktemp("sims"), **options) as urls:
        yield urls[0]
