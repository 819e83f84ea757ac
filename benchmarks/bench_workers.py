"""Several workers per pod: peak small-request throughput with 1 and 2 gateway workers vs the Rust router.

    python benchmarks/bench_workers.py             # ~2 min
    python benchmarks/bench_workers.py --quick     # ~40 s smoke run

One run, the same instant simulated replica behind every row, measured the same way
(closed loop, ``--concurrency`` connections, small non-streaming chat requests, as in
``bench_proxy.py``, whose load generator this reuses):

- ``direct``: the replica itself (the ceiling of this machine's load generator + replica);
- ``gateway x1`` / ``gateway x2``: ``prefix-gateway serve --workers N`` (N processes on one
  port with SO_REUSEPORT, sharing state through the local broker);
- ``sglang-router``: ``sglang_router.launch_router`` (policy cache_aware), when installed.

Then the added latency of ``gateway x2`` over direct at a fixed 300 req/s (open loop).
Targets (issue 10): x2 >= 0.6 x the router's req/s; added p50 <= 1 ms.  On a shared 2-core
machine the generator, the replica and the gateway compete for the same cores: read the ratios
of one run, not absolute numbers.  Results: a table on stdout and
``benchmarks/results/bench_workers.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import peer_sglang  # noqa: E402
from benchmarks.bench_proxy import SMALL_CHAT, closed_loop, ms, pct, phase_added_latency, run_async  # noqa: E402
from benchmarks.processes import stop_process  # noqa: E402
from gateway.sim import DEFAULT_MODEL  # noqa: E402
from gateway.sim.launcher import run_replicas  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_workers.json"
TARGETS = {"x2_vs_router": 0.6, "added_p50_ms": 1.0}


@contextmanager
def gateway_workers(replica_url: str, workers: int, workdir: Path) -> Iterator[str]:
    """``prefix-gateway serve --workers N`` on a free port; yields its base URL once every worker is ready."""
    config = {
        "server": {"host": "127.0.0.1", "port": 0, "drain_grace_s": 0},
        "replicas": [{"name": "r0", "url": replica_url}],
        "routes": [{"name": "bench", "match": {"models": [DEFAULT_MODEL]}, "policy": "least_loaded"}],
    }
    config_path = workdir / f"gateway-x{workers}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = workdir / f"gateway-x{workers}.log"
    log = log_path.open("w")
    cmd = [sys.executable, "-m", "gateway", "serve", "--config", str(config_path), "--workers", str(workers)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while True:
            found = re.findall(r"listening on (http://127\.0\.0\.1:\d+)", log_path.read_text())
            if len(found) >= workers:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start; see {log_path}")
            time.sleep(0.05)
        url = found[0]
        while True:  # every worker has finished its startup (first probes) once the log says so
            if log_path.read_text().count("Application startup complete") >= workers:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway workers not ready; see {log_path}")
            time.sleep(0.05)
        yield url
    finally:
        stop_process(proc, signal.SIGTERM, 20)
        log.close()


def peak(url: str, concurrency: int, duration: float) -> dict[str, Any]:
    body = json.dumps(SMALL_CHAT).encode()
    result = run_async(closed_loop(url + "/v1/chat/completions", body, concurrency, duration, False))
    return {
        "rps": round(result["rps"], 1),
        "p50_ms": ms(pct(result["latencies"], 0.5)),
        "p99_ms": ms(pct(result["latencies"], 0.99)),
        "errors": result["errors"],
    }


def median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row's median round by req/s, with every round's req/s beside it."""
    ordered = sorted(runs, key=lambda r: r["rps"])
    return {**ordered[len(ordered) // 2], "rounds_rps": [r["rps"] for r in runs]}


def peak_lines(results: dict[str, Any], note: str = "") -> list[str]:
    """The peak table's heading and one line per row, each against the SGLang router's req/s."""
    rows = results["peak"]
    router = rows.get("sglang-router", {}).get("rps")
    lines = [
        f"peak small-request throughput, {results['concurrency']} connections, median of {results['peak_rounds']} "
        f"rounds of {results['duration_s']} s per row (rows interleaved{note})",
        f"{'row':<16}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}{'vs router':>11}",
    ]
    for name, row in rows.items():
        ratio = f"{row['rps'] / router:.2f}x" if router else "-"
        lines.append(
            f"{name:<16}{row['rps']:>10.0f}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}{row['errors']:>8}{ratio:>11}"
        )
    return lines


def table(results: dict[str, Any]) -> str:
    lines = peak_lines(results)
    added = results["added_latency_x2"]
    lines.append(
        f"added latency, gateway x2 at {added['rate']:.0f} req/s: p50 {added['added_p50_ms']:.3f} ms, "
        f"p99 {added['added_p99_ms']:.3f} ms (median of {added['rounds']} rounds)"
    )
    for key, value in results["verdict"].items():
        lines.append(f"{key}: {value}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases (smoke run)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=None, help="seconds per peak row")
    args = parser.parse_args(argv)
    duration = args.duration or (2.0 if args.quick else 3.0)
    peak_rounds = 2 if args.quick else 4
    rounds, round_s = (2, 2.0) if args.quick else (4, 4.0)
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
        "concurrency": args.concurrency,
        "duration_s": duration,
        "peak_rounds": peak_rounds,
        "peak": {},
    }
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-workers-"))
        workdir = Path(tmp)
        urls = stack.enter_context(
            run_replicas(1, time_scale=0, disable_uvicorn_access_log=True, disable_log_stats=True, log_dir=workdir)
        )
        direct = urls[0]
        # every row is up at once and measured in turn, round after round: a busy moment on the
        # machine then hits one round of every row, not every round of one row
        targets = {"direct": direct}
        for workers in (1, 2):
            targets[f"gateway x{workers}"] = stack.enter_context(gateway_workers(direct, workers, workdir))
        reason = peer_sglang.unavailable_reason()
        if reason is None:
            router = peer_sglang.start([direct], workdir)
            stack.callback(router.stop)
            peer_sglang.wait_ready(router, DEFAULT_MODEL)
            targets["sglang-router"] = router.url
        else:
            results["sglang_router_skipped"] = reason
        per_round: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
        for _ in range(peak_rounds):
            for name, url in targets.items():
                per_round[name].append(peak(url, args.concurrency, duration))
        for name, runs in per_round.items():
            results["peak"][name] = median_round(runs)
        results["added_latency_x2"] = {
            k: v
            for k, v in phase_added_latency(direct, targets["gateway x2"], 300.0, round_s, rounds).items()
            if k != "per_round"
        }
    rows = results["peak"]
    router_rps = rows.get("sglang-router", {}).get("rps")
    x1, x2 = rows["gateway x1"]["rps"], rows["gateway x2"]["rps"]
    results["verdict"] = {
        "x2_vs_x1": round(x2 / x1, 3) if x1 else None,
        "x2_vs_router": round(x2 / router_rps, 3) if router_rps else None,
        "x2_vs_router_target": TARGETS["x2_vs_router"],
        "added_p50_ms": results["added_latency_x2"]["added_p50_ms"],
        "added_p50_target_ms": TARGETS["added_p50_ms"],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
