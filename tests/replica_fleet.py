"""Reusing one set of simulated replica processes across tests, each test seeing a fresh fleet.

Starting four replica processes costs 1.5-4 s on a busy 2-core machine (interpreter, imports,
tokenizer), more than most end-to-end tests take themselves.  So the e2e packages start their
fleet once and, before every test, put it back in the state a fresh start has: every replica
alive, running and answering ``/health``, no injected faults, an empty prefix cache and
counters from zero (``POST /sim/restart`` with ``reset_metrics``).  A test's assertions then
do not depend on which tests ran before it, as with a fleet of its own.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.sim.launcher import ReplicaGroup


def restore(group: ReplicaGroup, *, empty_caches: bool = False) -> None:
    """Every replica of ``group`` alive, running and fault-free; with ``empty_caches`` also as
    just started (empty prefix cache, zeroed counters; needs ``enable_admin``)."""
    for replica in group.replicas:
        replica.signal(signal.SIGCONT)  # a frozen (SIGSTOP) replica answers nothing
    for index in group.dead():
        group.restart(index)
    group.wait_healthy(30)
    with httpx.Client(timeout=10) as http:
        for url in group.urls:
            http.post(f"{url}/sim/faults", json={"reset": True}).raise_for_status()
            if empty_caches:
                http.post(f"{url}/sim/restart", json={"reset_metrics": True}).raise_for_status()


def fresh(group: ReplicaGroup) -> ReplicaGroup:
    """``group`` as a freshly started fleet (see the module docstring), for a function fixture."""
    restore(group, empty_caches=True)
    return group


def kv_event_endpoints(group: ReplicaGroup) -> list[tuple[str, str | None]]:
    """Per replica, where to connect for its KV events: (publisher, replay); needs ``kv_events``."""
    out = []
    for replica in group.replicas:
        if replica.kv_events_endpoint is None:
            raise ValueError("the group was started without kv_events=True")
        out.append((replica.kv_events_endpoint, replica.kv_replay_endpoint))
    return out


@contextlib.contextmanager
def shared_group(
    tmp_path_factory: pytest.TempPathFactory, name: str, n: int, *, kv_events: bool = False, **options: Any
) -> Iterator[ReplicaGroup]:
    """``n`` replicas for a fixture wider than one test, logging under a fresh ``name`` folder;
    stopped (thawed first) at the end.  ``kv_events``: each replica publishes vLLM's KV events
    on free ports of its own (:func:`kv_event_endpoints`); :func:`fresh` restarts them, so
    their sequences start again from 0, as after an engine restart."""
    group = ReplicaGroup(n, log_dir=tmp_path_factory.mktemp(name), kv_events=kv_events, **options)
    group.start()
    try:
        yield group
    finally:
        for replica in group.replicas:
            replica.signal(signal.SIGCONT)  # a stopped process ignores SIGTERM until continued
        group.stop()
