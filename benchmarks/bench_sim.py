"""How many requests per second ONE simulator process sustains at --time-scale 0.

    python benchmarks/bench_sim.py              # ~1 min: every scenario, 5 s each
    python benchmarks/bench_sim.py --quick      # ~15 s smoke run
    python benchmarks/bench_sim.py --duration 10 --concurrency 8 64 256

The simulator must never be the bottleneck when the gateway is measured, so the headline
scenario is the one the gateway benchmarks send: small non-streaming chat requests, with
the replica's default (noisy) access log on.  Target (issue 2): >= 1,500 req/s per process.

The replica runs in its own process (started with :func:`gateway.sim.launcher.ReplicaGroup`,
its output sent to a temp log file); this process is the load generator (aiohttp on uvloop,
closed loop, N concurrent connections).  On a 2-core machine the two share the CPU, so the
number is a floor; the sim's own CPU use (from /proc) tells whether it was saturated.
Only requests answered 200 count as served (``requests``, req/s, the latencies, req/s per
sim core); any other status or a failed connection is an ``errors``, counted apart and not
timed, and the run goes on.  Results: a table on stdout and ``benchmarks/results/bench_sim.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.procstat import cpu_seconds  # noqa: E402
from gateway.sim import DEFAULT_MODEL  # noqa: E402
from gateway.sim.launcher import ReplicaGroup  # noqa: E402

TARGET_RPS = 1500
RESULTS = ROOT / "benchmarks" / "results" / "bench_sim.json"

SMALL_CHAT = {
    "model": DEFAULT_MODEL,
    "messages": [{"role": "user", "content": "Hello! Can you tell me a short fact about the sea?"}],
    "max_tokens": 16,
}
LONG_SYSTEM = " ".join(f"rule {i}: answer politely and cite the handbook section {i}." for i in range(160))


@dataclass
class Scenario:
    name: str
    path: str
    body: dict[str, Any]
    replica: str  # "default" (access log on) or "quiet"
    headline: bool = False


SCENARIOS = [
    Scenario("chat, small, non-stream", "/v1/chat/completions", SMALL_CHAT, "default", headline=True),
    Scenario("chat, small, non-stream, no access log", "/v1/chat/completions", SMALL_CHAT, "quiet"),
    Scenario(
        "completions, small, non-stream",
        "/v1/completions",
        {"model": DEFAULT_MODEL, "prompt": "The sea is", "max_tokens": 16},
        "default",
    ),
    Scenario("chat, small, stream (16 chunks)", "/v1/chat/completions", {**SMALL_CHAT, "stream": True}, "default"),
    Scenario(
        "chat, ~2,000-token cached prefix, non-stream",
        "/v1/chat/completions",
        {
            "model": DEFAULT_MODEL,
            "messages": [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Which rule?"}],
            "max_tokens": 16,
        },
        "default",
    ),
]


@dataclass
class Result:
    scenario: str
    replica: str
    concurrency: int
    requests: int  # served: answered 200 in the timed window
    errors: int  # any other status or a failed connection in the timed window
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    sim_cpu_pct: float
    rps_per_sim_core: float  # req/s per second of sim CPU: its capacity with a whole core to itself
    headline: bool


async def _load(
    url: str, body: bytes, concurrency: int, duration: float, pid: int
) -> tuple[int, int, float, list[float], float]:
    """Closed-loop load after a short warm-up: (served, errors, seconds, latencies of the served,
    sim CPU seconds).  Served: answered 200; errors: the rest, a refused or cut connection too
    (one replica hiccup must not end the run and lose the rows measured so far)."""
    latencies: list[float] = []
    errors = 0
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(stop_at: float, record: bool) -> None:
            nonlocal errors
            while time.perf_counter() < stop_at:
                start = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except aiohttp.ClientError:
                    ok = False
                if not record:
                    continue
                if ok:
                    latencies.append(time.perf_counter() - start)
                else:
                    errors += 1

        warm_until = time.perf_counter() + min(1.0, duration / 4)
        await asyncio.gather(*(worker(warm_until, False) for _ in range(concurrency)))
        cpu0 = cpu_seconds(pid)
        start = time.perf_counter()
        await asyncio.gather(*(worker(start + duration, True) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        cpu = cpu_seconds(pid) - cpu0
    return len(latencies), errors, elapsed, latencies, cpu


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(duration: float, concurrencies: list[int], quick: bool) -> list[Result]:
    import uvloop

    results: list[Result] = []
    with tempfile.TemporaryDirectory() as logs:
        common = {"time_scale": 0, "log_stats_interval": 10.0}
        groups = {
            "default": ReplicaGroup(1, log_dir=Path(logs) / "default", **common).start(),
            "quiet": ReplicaGroup(1, log_dir=Path(logs) / "quiet", disable_uvicorn_access_log=True, **common).start(),
        }
        try:
            for scenario in SCENARIOS if not quick else SCENARIOS[:2]:
                group = groups[scenario.replica]
                url = group.urls[0] + scenario.path
                pid = group.replicas[0].process.pid  # type: ignore[union-attr]
                levels = concurrencies if scenario.headline else [max(concurrencies)]
                for concurrency in levels:
                    n, errors, elapsed, latencies, cpu_s = uvloop.run(
                        _load(url, json.dumps(scenario.body).encode(), concurrency, duration, pid)
                    )
                    cpu = cpu_s / elapsed * 100
                    result = Result(
                        scenario=scenario.name,
                        replica=scenario.replica,
                        concurrency=concurrency,
                        requests=n,
                        errors=errors,
                        seconds=round(elapsed, 2),
                        rps=round(n / elapsed, 1),
                        p50_ms=round(_percentile(latencies, 0.50) * 1000, 2),
                        p99_ms=round(_percentile(latencies, 0.99) * 1000, 2),
                        sim_cpu_pct=round(cpu, 1),
                        rps_per_sim_core=round(n / cpu_s, 0) if cpu_s > 0 else 0.0,
                        headline=scenario.headline,
                    )
                    results.append(result)
                    print(
                        f"  {result.scenario:<46} c={concurrency:<4} {result.rps:>9,.0f} req/s  "
                        f"p50 {result.p50_ms:6.1f} ms  p99 {result.p99_ms:6.1f} ms  "
                        f"sim CPU {result.sim_cpu_pct:5.1f}%  ({result.rps_per_sim_core:,.0f} req/s per sim core)",
                        flush=True,
                    )
        finally:
            for group in groups.values():
                group.stop()
    return results


def print_table(results: list[Result]) -> None:
    print()
    header = ("scenario", "conc", "req/s", "p50 ms", "p99 ms", "sim CPU", "req/s per sim core", "errors")
    widths = (46, 4, 9, 7, 7, 7, 18, 6)
    cells = [f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(zip(header, widths, strict=True))]
    print("| " + " | ".join(cells) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in results:
        cells = (
            f"{r.scenario:<46}",
            f"{r.concurrency:>4}",
            f"{r.rps:>9,.0f}",
            f"{r.p50_ms:>7.1f}",
            f"{r.p99_ms:>7.1f}",
            f"{r.sim_cpu_pct:>6.1f}%",
            f"{r.rps_per_sim_core:>18,.0f}",
            f"{r.errors:>6}",
        )
        print("| " + " | ".join(cells) + " |")
    print(
        "\nreq/s is what this run achieved with the load generator on the same cores; 'req/s per sim core'\n"
        "(requests / sim CPU-seconds) is the simulator's capacity with a core to itself."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per scenario and level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 64], help="connections in flight")
    parser.add_argument("--quick", action="store_true", help="headline scenarios only, 2 s each")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    duration = 2.0 if args.quick else args.duration
    print(f"one simulator process at --time-scale 0; {duration:g} s per run; target {TARGET_RPS:,} req/s", flush=True)
    results = run(duration, args.concurrency, args.quick)
    print_table(results)
    headline = [r for r in results if r.headline]
    worst = min(r.rps for r in headline)
    passed = worst >= TARGET_RPS and not any(r.errors for r in results)
    print(f"\nheadline (small non-streaming chat, access log on): worst {worst:,.0f} req/s -> "
          f"{'PASS' if passed else 'FAIL'} (target >= {TARGET_RPS:,} req/s per process)")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "bench_sim",
                "target_rps": TARGET_RPS,
                "passed": passed,
                "headline_worst_rps": worst,
                "duration_s": duration,
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                },
                "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "results": [asdict(r) for r in results],
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
