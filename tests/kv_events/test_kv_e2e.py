"""End to end: simulated replicas serve, a test ZMQ publisher per replica plays its engine's KV
events, and the gateway (official SDK in front) routes by what the "engine" says it holds —
also after ``AllBlocksCleared`` and after an engine restart (sequence back to 0).

The simulator does not publish events yet (the ``simkv`` work); until it does, the events
come from ``tests/kv_events/publisher.py`` (vLLM's wire format), listed in
``kv_events.endpoints`` as ``tcp://*:PORT`` (read as each replica's own host).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.prefix.pipeline import PrefixPipeline
from gateway.prefix.settings import NormalizeSettings, PrefixSettings
from gateway.sim.launcher import ReplicaGroup
from tests.configs import gateway_config
from tests.kv_events.frames import cleared, hashes_for, stored
from tests.kv_events.publisher import TestPublisher
from tests.polling import wait_for
from tests.replica_fleet import fresh, shared_group
from tests.sdk import openai_client

pytestmark = pytest.mark.slow

MODEL = "demo-model"
BS = 16
ADMIN_KEY = "kv-e2e-admin"
SIM_OPTIONS = {
    "tokenizer": "cl100k_base",
    "time_scale": 0,
    "enable_admin": True,
    "max_output_tokens": 4,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaGroup]:
    with shared_group(tmp_path_factory, "kv-sims", 3, **SIM_OPTIONS) as group:
        yield group


@pytest.fixture
def publishers() -> Iterator[list[TestPublisher]]:
    pubs = [TestPublisher(replay=True) for _ in range(3)]
    yield pubs
    for pub in pubs:
        pub.close()


def _stats(api: httpx.Client) -> dict[str, Any]:
    response = api.get("/admin/stats")
    response.raise_for_status()
    return response.json()["kv_events"]["replicas"]


def _connect(api: httpx.Client, pubs: list[TestPublisher]) -> None:
    """Past ZMQ's slow-joiner window: publish until every replica's feed heard something."""
    deadline = time.monotonic() + 20
    while True:
        rows = _stats(api)
        if all(rows[f"r{i}"]["messages"] > 0 for i in range(len(pubs))):
            return
        assert time.monotonic() < deadline, f"feeds never heard: {rows}"
        for i, pub in enumerate(pubs):
            if rows[f"r{i}"].get("messages", 0) == 0:
                pub.publish([])
        time.sleep(0.05)


def _blocks_on(api: httpx.Client, name: str, count: int) -> None:
    wait_for(lambda: _stats(api)[name]["indexed_blocks"] == count, 10, what=f"{name} to index {count} blocks")


def test_routing_follows_the_engines_events_through_clears_and_restarts(
    sims: ReplicaGroup, publishers: list[TestPublisher], monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh(sims)
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    endpoints = {
        f"r{i}": [{"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}]
        for i, pub in enumerate(publishers)
    }
    config = gateway_config(
        sims.urls,
        routes=[{"name": "main", "match": {"models": [MODEL]}, "policy": "prefix"}],
        kv_events={"endpoints": endpoints, "speculative_s": 0, "discover": False},
    )
    from gateway.http.server import serve_in_thread

    messages = [
        {"role": "system", "content": "You are the reference desk. " + "Cite every source you use. " * 40},
        {"role": "user", "content": "Where are the atlases?"},
    ]
    tokens = list(
        PrefixPipeline(NormalizeSettings(), PrefixSettings()).window_tokens(
            "chat", {"model": MODEL, "messages": messages}
        )
    )
    blocks = len(tokens) // BS
    held = tokens[: blocks * BS]
    assert blocks >= 10

    with (
        serve_in_thread(config) as gw,
        httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30) as api,
    ):
        sdk = openai_client(gw.openai_base_url, api_key="unused", timeout=30)

        def ask() -> str:
            raw = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4)
            raw.parse()
            return raw.headers["x-prefix-gateway-replica"]

        def explain() -> dict[str, Any]:
            response = api.post("/admin/explain", json={"model": MODEL, "messages": messages})
            response.raise_for_status()
            return response.json()

        _connect(api, publishers)
        assert {row["mode"] for row in _stats(api).values()} == {"precise"}

        # the "engine" of r2 says it holds the prompt: the gateway sends it there
        publishers[2].publish([stored(hashes_for(blocks, 100), held, BS)])
        _blocks_on(api, "r2", blocks)
        assert ask() == "r2"

        # r2's cache was reset and r0 computed the prompt: the model remembers r2, the engine r0
        publishers[2].publish([cleared()])
        publishers[0].publish([stored(hashes_for(blocks, 200), held, BS)])
        _blocks_on(api, "r2", 0)
        _blocks_on(api, "r0", blocks)
        assert ask() == "r0"

        # r0's engine restarted (its sequence starts at 0 again: its cache is empty) and r1 holds it
        publishers[0].restart()
        publishers[0].publish([stored(hashes_for(2, 900), list(range(2 * BS)), BS)])
        publishers[1].publish([stored(hashes_for(blocks, 300), held, BS)])
        wait_for(lambda: _stats(api)["r0"]["restarts"] == 1, 10, what="the restart")
        _blocks_on(api, "r0", 2)
        _blocks_on(api, "r1", blocks)
        assert ask() == "r1"

        plan = explain()
        text = str(plan)
        assert "precise" in text  # explain says how the pick was matched

        metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
        for i in range(3):
            assert f'prefix_gateway_kv_events_mode{{mode="precise",replica="r{i}"}} 1.0' in metrics
        assert 'prefix_gateway_kv_events_restarts_total{replica="r0"} 1.0' in metrics
        stats = api.get("/admin/stats").json()
        assert stats["routes"]["main"]["replicas"]["r1"]["kv_mode"] == "precise"
