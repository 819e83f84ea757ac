"""Replica processes: run_replicas for tests, and the ``sim`` CLI (``python -m gateway.sim``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sim_helpers import client, poll, scrape

from gateway.sim import DEFAULT_MODEL
from gateway.sim.launcher import ReplicaGroup, ReplicaStartError, run_replicas

ROOT = Path(__file__).resolve().parents[2]


def _refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)
    except httpx.ConnectError:
        return True
    return False


@pytest.mark.slow
def test_run_replicas_processes_per_replica_options_and_cleanup(tmp_path: Path) -> None:
    with run_replicas(
        2,
        per_replica=[{}, {"num_gpu_blocks": 64, "model": "other"}],
        time_scale=0,
        log_stats_interval=0.1,
        log_dir=tmp_path,
    ) as urls:
        assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
        assert not any(u.endswith("/v1") for u in urls)
        resp = client(urls[0]).chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert resp.usage is not None and resp.usage.completion_tokens == 3
        assert client(urls[1]).models.list().data[0].id == "other"
        blocks = [
            next(k for k in scrape(u) if k.startswith("vllm:cache_config_info")).split("num_gpu_blocks=")[1]
            for u in urls
        ]
        assert blocks[0].startswith("8192") and blocks[1].startswith("64")
        # the process log has vLLM's noise: health checks in the access log and the engine line
        log0 = tmp_path / "replica-0.log"
        poll(lambda: "Engine 000: Avg prompt throughput:" in log0.read_text())
        text = log0.read_text()
        assert '"GET /health HTTP/1.1" 200' in text
        assert any(line.startswith("INFO ") and "] Engine 000: " in line for line in text.splitlines())
    assert all(_refused(u) for u in urls)


def test_processes_are_cleaned_up_on_exceptions_and_access_log_can_be_off(tmp_path: Path) -> None:
    group = ReplicaGroup(1, time_scale=0, disable_uvicorn_access_log=True, log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="boom"), group:
        httpx.get(group.urls[0] + "/health")
        raise RuntimeError("boom")
    assert group.dead() == [0]
    assert _refused(group.urls[0])
    assert "GET /health" not in (tmp_path / "replica-0.log").read_text()


def test_bad_options_fail_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="unknown simulator option"), run_replicas(1, time_scael=0):
        pass
    with pytest.raises(ValueError, match="block_size"), run_replicas(2, per_replica=[{}, {"block_size": 0}]):
        pass


@pytest.mark.slow
def test_kill_and_restart_one_replica(tmp_path: Path) -> None:
    with ReplicaGroup(2, time_scale=0, log_dir=tmp_path, disable_uvicorn_access_log=True) as group:
        c = client(group.urls[0])
        prompt = list(range(500, 600))
        c.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=1)
        group.kill(0)
        assert group.dead() == [0] and _refused(group.urls[0])
        assert httpx.get(group.urls[1] + "/health").status_code == 200
        assert group.restart(0) == group.urls[0]
        again = c.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=1)
        assert again.usage.prompt_tokens_details.cached_tokens == 0  # a fresh process, a cold cache


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair")


def _cli(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.sim", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.slow
def test_cli_starts_replicas_on_consecutive_ports_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = _free_port_pair()
    events = _free_port_pair()
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}", "topic": "kv"})
    proc = _cli(
        "--replicas", "2", "--port", str(port), "--time-scale", "0", "--log-dir", str(tmp_path),
        "--kv-events-config", config, "--kv-events-layout", "array", "--device", "cpu",
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines[0].startswith(f"replica 0: http://127.0.0.1:{port} ")
        assert lines[1].startswith(f"replica 1: http://127.0.0.1:{port + 1} ")
        assert "2 replica(s) ready" in lines[2]
        for p in (port, port + 1):
            resp = client(f"http://127.0.0.1:{p}").completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=2)
            assert resp.usage is not None
        # one --kv-events-config for N replicas: replica i publishes on PORT+i, as vLLM's DP ranks
        for i, p in enumerate((port, port + 1)):
            source = httpx.get(f"http://127.0.0.1:{p}/kv_event_sources").json()["0"]
            assert source["endpoint"] == f"tcp://*:{events + i}" and source["topic"] == "kv"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _refused(f"http://127.0.0.1:{port}") and _refused(f"http://127.0.0.1:{port + 1}")


def test_cli_reports_a_busy_port_and_bad_flags() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _cli("--port", str(port), "--time-scale", "0")
        _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "cannot listen" in err
    proc = _cli("--block-size", "0")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "block_size" in err


def test_replica_start_error_names_the_replica(tmp_path: Path) -> None:
    # options validate, but the child cannot load this tokenizer and exits during startup
    with (
        pytest.raises(ReplicaStartError, match=r"replica 0 .* exited"),
        run_replicas(1, tokenizer="/nonexistent/tokenizer.json", time_scale=0, log_dir=tmp_path),
    ):
        pass
    assert "tokenizer" in (tmp_path / "replica-0.log").read_text()
