"""``prefix-gateway demo --envoy``: the embedded demo with a real Envoy in front and the gateway as its picker.

Simulated replicas (as ``demo``), the picker in a background thread on free ports, and Envoy
on ``--port`` with the standalone config (``envoy.template.yaml``) filled for them.  The
same two-command equivalent is in docs/endpoint-picker.md.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from gateway.config import GatewayConfig

STARTUP_S = 30.0


def check_envoy() -> str | None:
    """Why ``demo --envoy`` cannot run here (the extra or the binary missing), else None."""
    from gateway.epp import require_grpc
    from gateway.epp.envoy_config import INSTALL_ENVOY, envoy_binary

    require_grpc()
    if envoy_binary() is None:
        return f"no envoy binary on PATH; install it: {INSTALL_ENVOY}"
    return None


def serve_behind_envoy(
    config: GatewayConfig, urls: Sequence[str], port: int, log_dir: str, announce: Callable[[str, int], None]
) -> int:
    """Serve ``config`` as the picker with Envoy on ``port`` (0: any) until Envoy exits or a signal.

    ``announce(envoy_url, picker_metrics_port)`` once both serve (the CLI prints its banner).
    """
    from gateway.epp.envoy_config import EnvoyPorts, envoy_binary, render
    from gateway.epp.server import Listen, PickerServer
    from gateway.sim.launcher import free_port

    binary = envoy_binary()
    assert binary is not None  # check_envoy() said so
    picker = PickerServer(config, Listen("127.0.0.1", 0, 0)).start_in_thread()
    ports = EnvoyPorts(listen_port=port or free_port(), admin_port=free_port(), picker_port=picker.grpc_port)
    envoy_yaml = Path(log_dir) / "envoy.yaml"
    envoy_yaml.write_text(render(urls, ports, fail_open=False))
    with (Path(log_dir) / "envoy.log").open("wb") as log:
        envoy = subprocess.Popen(
            [binary, "-c", str(envoy_yaml), "--log-level", "warn", "--disable-hot-restart"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_live(envoy, f"http://127.0.0.1:{ports.admin_port}/ready", log_dir)
        announce(f"http://127.0.0.1:{ports.listen_port}", picker.metrics_port)
        print(f"Envoy config: {envoy_yaml}    Envoy admin: http://127.0.0.1:{ports.admin_port}", flush=True)
        envoy.wait()
        print(f"envoy exited ({envoy.returncode}); see {log_dir}/envoy.log", file=sys.stderr)
        return 1
    finally:
        if envoy.poll() is None:
            envoy.terminate()
            envoy.wait(10)
        picker.stop()


def _wait_live(envoy: subprocess.Popen[bytes], ready_url: str, log_dir: str) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if envoy.poll() is not None:
            raise SystemExit(f"prefix-gateway demo --envoy: envoy exited at start; see {log_dir}/envoy.log")
        try:
            if httpx.get(ready_url, timeout=1).text.strip() == "LIVE":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"prefix-gateway demo --envoy: envoy not live after {STARTUP_S:.0f} s; see {log_dir}/envoy.log")
