"""``serve --workers 2``: two processes on one port that share affinity and load (local broker)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
import yaml

from gateway.config import parse_config
from gateway.http import workers
from gateway.sim.launcher import ReplicaGroup
from gateway.state.local_broker import LocalBroker
from tests.fleet.fleet_helpers import MODEL, shared_free_port
from tests.polling import until, wait_for

ADMIN = {"Authorization": "Bearer workers-admin"}
SYSTEM = {"role": "system", "content": "You answer questions about trains. " * 60}


async def test_the_local_broker_speaks_enough_redis_for_pub_sub(tmp_path: Path) -> None:
    broker = LocalBroker(str(tmp_path / "b.sock"))
    await broker.start()
    a, b = aioredis.from_url(broker.url), aioredis.from_url(broker.url)
    try:
        assert await a.ping()
        pubsub = b.pubsub()
        await pubsub.subscribe("chan")
        await until(lambda: broker._channels[b"chan"])
        assert await a.publish("chan", b"\x00binary\r\n payload") == 1
        message = None
        for _ in range(50):
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
            if message:
                break
        assert message is not None and message["data"] == b"\x00binary\r\n payload"
        assert await a.publish("other", b"x") == 0
        await pubsub.aclose()
    finally:
        await a.aclose()
        await b.aclose()
        await broker.stop()
    assert not os.path.exists(broker.path)


@pytest.mark.slow
def test_two_workers_on_one_port_share_affinity(tmp_path: Path) -> None:
    with ReplicaGroup(2, log_dir=tmp_path / "sims", time_scale=0, disable_uvicorn_access_log=True).start() as sims:
        port = shared_free_port(["127.0.0.1"])
        config = {
            # short shutdown bounds: a worker stuck in shutdown is killed well within the wait below
            "server": {"port": port, "drain_grace_s": 0.2, "timeout_graceful_shutdown_s": 2},
            "logging": {"summary_interval_s": 0},
            "replicas": [{"name": f"r{i}", "url": url} for i, url in enumerate(sims.urls)],
            "routes": [{"name": "main", "policy": "prefix"}],
        }
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {
            **os.environ,
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            "PREFIX_GATEWAY_ADMIN_KEY": "workers-admin",
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--workers", "2"],
            env=env,
            stderr=subprocess.PIPE,
        )
        url = f"http://127.0.0.1:{port}"
        try:

            def stats() -> dict | None:
                try:  # a fresh connection each time: the kernel picks a worker per connection
                    with httpx.Client(base_url=url, headers=ADMIN, timeout=5) as http:
                        return http.get("/admin/stats").json()
                except httpx.HTTPError:
                    return None

            pods: set[str] = set()
            wait_for(lambda: stats() is not None, timeout=30, what="a worker serving")

            def both_seen() -> bool:
                found = stats()
                if found and found["state"].get("connected"):
                    pods.add(found["state"]["pod"])
                return len(pods) == 2

            wait_for(both_seen, timeout=30, what="two workers (distinct pod ids) answering on one port")

            messages = [SYSTEM, {"role": "user", "content": "When does the last train leave?"}]
            with httpx.Client(base_url=url, timeout=10) as http:
                first = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4})
            home = first.headers["x-prefix-gateway-replica"]
            turn2 = [
                *messages,
                {"role": "assistant", "content": "At midnight."},
                {"role": "user", "content": "And on Sunday?"},
            ]

            def explained() -> dict:
                with httpx.Client(base_url=url, headers=ADMIN, timeout=5) as http:
                    body = {"model": MODEL, "messages": turn2, "max_tokens": 4}
                    return http.post("/admin/explain", json=body).json()["decision"]

            # every worker (fresh connections land on both) knows where turn 1 went
            answered = [explained() for _ in range(12)]
            wait_for(
                lambda: all(d["reason"] == "affinity" for d in [explained() for _ in range(6)]),
                what="affinity known to every worker",
            )
            assert all(d["replica"] == home for d in answered)
        finally:
            process.send_signal(signal.SIGTERM)
            _, err = process.communicate(timeout=60)
        assert "killing it" not in err.decode(), err.decode()[-3000:]
        assert process.returncode == 0
        assert "2 workers on http://127.0.0.1:" in err.decode()


async def test_a_worker_stuck_in_shutdown_is_killed_and_the_exit_code_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod must not hang in Terminating on one worker that never finishes its shutdown."""
    monkeypatch.setattr(workers, "STOP_TIMEOUT_S", 0.0)
    monkeypatch.setattr(workers, "KILL_MARGIN_S", 0.5)
    config = parse_config(
        {
            "server": {"port": 0, "drain_grace_s": 0, "timeout_graceful_shutdown_s": 0},
            "replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}],
        },
        "<test>",
    )
    supervisor = workers.Supervisor(config, 2, None)
    ready = tmp_path / "ready"
    stuck = "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    stuck += f"pathlib.Path({str(ready)!r}).with_suffix('.' + sys.argv[1]).touch(); time.sleep(120)"
    commands = iter(["a", "b"])
    monkeypatch.setattr(supervisor, "worker_command", lambda _: [sys.executable, "-c", stuck, next(commands)])
    running = asyncio.ensure_future(supervisor.run())
    await until(lambda: ready.with_suffix(".a").exists() and ready.with_suffix(".b").exists(), timeout=20)
    supervisor._stop(signal.SIGTERM)
    code = await asyncio.wait_for(running, timeout=20)
    assert code == 1 and supervisor.killed == 2
    assert all(process.returncode == -signal.SIGKILL for process in supervisor.children.values())
