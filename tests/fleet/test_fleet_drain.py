"""Graceful drain: SIGTERM during 20 running streams — all finish, /ready is 503 at once, the
listener closes after the grace, and the process exits before its deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI

from gateway.sim.launcher import ReplicaGroup
from tests.fleet.fleet_helpers import MODEL, SLOW, shared_free_port
from tests.polling import wait_for

STREAMS = 20
DEADLINE_S = 30.0  # server.timeout_graceful_shutdown_s
GRACE_S = 1.0  # server.drain_grace_s


@pytest.mark.slow
def test_sigterm_lets_running_streams_finish(tmp_path: Path) -> None:
    slow = {**SLOW, "decode_ms_per_token": 100.0, "max_output_tokens": 30}  # ~3 s per stream
    with ReplicaGroup(2, log_dir=tmp_path / "sims", **slow).start() as sims:
        port = shared_free_port(["127.0.0.1"])
        config = {
            "server": {"port": port, "timeout_graceful_shutdown_s": DEADLINE_S, "drain_grace_s": GRACE_S},
            "logging": {"summary_interval_s": 0},
            "replicas": [{"name": f"r{i}", "url": url} for i, url in enumerate(sims.urls)],
            "routes": [{"name": "main", "policy": "least_loaded"}],
        }
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        url = f"http://127.0.0.1:{port}"
        try:

            def ready_status() -> int | None:
                try:
                    return httpx.get(f"{url}/ready", timeout=2).status_code
                except httpx.HTTPError:
                    return None

            wait_for(lambda: ready_status() == 200, timeout=30, what="the gateway ready")
            started = threading.Semaphore(0)
            finished: list[str] = []
            failures: list[str] = []

            def stream(i: int) -> None:
                client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
                try:
                    chunks = client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"story {i}"}],
                        stream=True,
                        max_tokens=30,
                        extra_body={"ignore_eos": True},
                    )
                    first = True
                    for chunk in chunks:
                        if first:
                            started.release()
                            first = False
                        if chunk.choices and chunk.choices[0].finish_reason:
                            finished.append(chunk.choices[0].finish_reason)
                except Exception as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    started.release()

            threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(STREAMS)]
            for thread in threads:
                thread.start()
            for _ in range(STREAMS):
                assert started.acquire(timeout=30)
            assert failures == []

            process.send_signal(signal.SIGTERM)
            wait_for(lambda: ready_status() == 503, timeout=2, interval=0.01, what="/ready 503 after SIGTERM")
            # after the grace the listener is closed: new connections are refused
            wait_for(lambda: ready_status() is None, timeout=10, what="new connections refused")
            for thread in threads:
                thread.join(DEADLINE_S)
            assert failures == []
            assert finished == ["length"] * STREAMS  # every stream ran to its end
            assert process.wait(timeout=DEADLINE_S) == 0  # exited cleanly, before the deadline
        finally:
            if process.poll() is None:
                process.kill()
            _, err = process.communicate(timeout=30)
        log = err.decode()
        assert "draining: /ready is 503" in log
        assert "timeout graceful shutdown exceeded" not in log
