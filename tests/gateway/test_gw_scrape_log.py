"""A failing engine scrape is logged when it starts failing and when it works again, not every interval."""

from __future__ import annotations

import logging

import pytest

from gateway.config import HealthSettings, ReplicaConfig, ScrapeSettings
from gateway.replicas.monitor import ReplicaMonitor
from gateway.replicas.pool import Replica

METRICS = b'vllm:num_requests_running{model_name="m"} 1.0\nvllm:num_requests_waiting{model_name="m"} 0.0\n'


class ScriptedClient:
    """Answers GET /metrics with the next (status, body) of its script."""

    def __init__(self, script: list[tuple[int, bytes]]) -> None:
        self.script = script

    async def get(self, path: str, timeout: float, headers: object = None) -> tuple[int, bytes]:
        return self.script.pop(0)


async def test_a_failing_scrape_is_logged_once_and_its_recovery_once(caplog: pytest.LogCaptureFixture) -> None:
    client = ScriptedClient([(200, METRICS), (404, b""), (404, b""), (404, b""), (200, METRICS)])
    replica = Replica(ReplicaConfig(name="r0", url="http://h:1"), client, HealthSettings())  # type: ignore[arg-type]
    monitor = ReplicaMonitor([replica], HealthSettings(), ScrapeSettings())
    with caplog.at_level(logging.INFO, logger="prefix_gateway.replicas"):
        await monitor.scrape_one(replica)
        assert replica.engine is not None and replica.engine_error is None
        for _ in range(3):
            await monitor.scrape_one(replica)
        assert replica.engine_error == "HTTP 404"
        await monitor.scrape_one(replica)
    lines = [r.getMessage() for r in caplog.records if "engine scrape" in r.getMessage()]
    assert lines == [
        "replica r0: engine scrape of /metrics fails (HTTP 404): its queue, KV usage and cache hits are unseen "
        "until it works again",
        "replica r0: engine scrape works again",
    ]
    assert replica.engine_error is None
