"""Fixtures for the simulator tests: in-thread replicas (cheap) and the openai SDK as client."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from openai import OpenAI
from sim_helpers import FAST, client

from gateway.sim.server import serve_in_thread

SimFactory = Callable[..., str]


@pytest.fixture
def make_sim() -> Iterator[SimFactory]:
    """``make_sim(**options) -> base URL``: a replica in a thread, stopped after the test."""
    with contextlib.ExitStack() as stack:

        def start(**options: Any) -> str:
            return stack.enter_context(serve_in_thread({**FAST, **options}))

        yield start


@pytest.fixture
def sim(make_sim: SimFactory) -> str:
    """A default instant replica with the admin endpoints on."""
    return make_sim(enable_admin=True)


@pytest.fixture
def oai(sim: str) -> OpenAI:
    return client(sim)
