"""``prefix-gateway demo --envoy``: the embedded demo with a real Envoy in front and the gateway as its picker.

Simulated replicas (as ``demo``), the picker in a background thread on free ports, and Envoy
on ``--port`` with the standalone config (``envoy.template.yaml``) filled for them.  The
same two-command equivalent is in docs/endpoint-picker.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

STARTUP_S = 30.0


def run_envoy_demo(args: argparse.Namespace) -> int:
    from gateway.epp import require_grpc
    from gateway.epp.envoy_config import INSTALL_ENVOY, envoy_binary

    require_grpc()
    binary = envoy_binary()
    if binary is None:  # before any replica starts: nothing to clean up
        print(f"prefix-gateway demo --envoy: no envoy binary on PATH; install it: {INSTALL_ENVOY}", file=sys.stderr)
        return 2
    from gateway.admin.local_key import remove_demo_key, write_demo_key
    from gateway.cli import _demo_model, _exit_cleanly_on_signals, demo_admin_key, demo_banner, demo_config
    from gateway.config import default_config_path, load_config
    from gateway.epp.envoy_config import EnvoyPorts, render
    from gateway.epp.server import Listen, PickerServer
    from gateway.sim.launcher import free_port, run_replicas

    path = Path(args.config) if args.config else default_config_path()
    base = load_config(path)
    model = _demo_model(base)
    log_dir = tempfile.mkdtemp(prefix="prefix-gateway-demo-")
    admin_key = demo_admin_key(base)
    print(f"starting {len(base.replicas)} simulated replicas, the picker and Envoy ...", flush=True)
    _exit_cleanly_on_signals()
    with run_replicas(len(base.replicas), time_scale=args.time_scale, model=model, log_dir=log_dir) as urls:
        config = demo_config(base, urls, 0, str(path), admin_key)
        picker = PickerServer(config, Listen("127.0.0.1", 0, 0)).start_in_thread()
        ports = EnvoyPorts(listen_port=args.port or free_port(), admin_port=free_port(), picker_port=picker.grpc_port)
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
            admin_url = f"http://127.0.0.1:{picker.metrics_port}"
            if admin_key is not None:
                try:
                    write_demo_key("127.0.0.1", picker.metrics_port, admin_key)
                except OSError as exc:
                    print(f"(admin key not saved for the CLI clients: {exc}; pass --admin-key)", flush=True)
            url = f"http://127.0.0.1:{ports.listen_port}"
            print(demo_banner(url, model, len(urls), log_dir, admin_key, admin_url), flush=True)
            print(f"Envoy config: {envoy_yaml}    Envoy admin: http://127.0.0.1:{ports.admin_port}", flush=True)
            envoy.wait()
            print(f"envoy exited ({envoy.returncode}); see {log_dir}/envoy.log", file=sys.stderr)
            return 1
        finally:
            if envoy.poll() is None:
                envoy.terminate()
                envoy.wait(10)
            picker.stop()
            remove_demo_key(picker.metrics_port)


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
