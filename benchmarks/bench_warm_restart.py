"""Warm restarts, measured: TTFT in the minute after a replica restart under load, warm-up on vs off.

    python benchmarks/bench_warm_restart.py --quick     # under 2 minutes: one run per row and scenario
    python benchmarks/bench_warm_restart.py             # 3 runs per row and scenario, medians (~8 minutes)
    python benchmarks/bench_warm_restart.py --downtime-s 0 --repeat 5

A steady open-loop stream of chat requests with repeated prefixes (``--prefixes`` documents of
``--prefix-tokens`` tokens, Zipf popularity, each request a unique question after its
document) goes through one gateway (``prefix`` policy) to 4 simulated vLLM replicas.  After
``--before-s`` simulated seconds, replica r1 restarts (``POST /sim/restart`` with
``reset_metrics``: its prefix cache is empty and its engine counters start from zero, like a
restarted vLLM).  Two scenarios by default (``--downtime-s``): a restart the gateway sees
only through the engine's counters going backwards (no downtime: the engine restarted between
two health checks), and one with 20 s of downtime first (503s), so health checks and outlier
detection take the replica out, its keys move to the others meanwhile, and it rejoins.  The
run goes on for the minute after the restart.

Rows: ``warm-up off`` (the gateway's default) and ``warm-up on`` (``warm_restart.enabled``),
each with a fresh gateway and emptied replica caches, on byte-identical traffic, alternating
over ``--repeat`` runs (medians in the table, every run in the JSON).  Reported
per row for the minute after the restart (and for the last stretch before it, as the steady
state): TTFT p50/p90/p99 and hit rate over all requests, TTFT p90, hit rate and cold requests
(less than half the prompt cached) among those served by the restarted replica, and the
warm-up replays the gateway sent.

Time is scaled as in ``bench_policies.py``: the simulated replicas run ``--time-scale`` wall
seconds per simulated second, so "the minute after the restart" is 60 simulated seconds
(``60 x time_scale`` wall seconds), and the gateway's own clocks (scrape and health-check
intervals, warm-up rate and cooldown) are scaled by the same factor, so detection delays and
replay pace take the same share of that minute as they would in real time.  TTFTs are
reported in wall-clock ms, as measured by the client.  Results: a table on stdout and
``benchmarks/results/bench_warm_restart.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import random
import re
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks import bench_policies as bp  # noqa: E402
from benchmarks.processes import serve_gateway  # noqa: E402
from benchmarks.replay import Outcome, WireRequest, median_of_runs, prepare, replay  # noqa: E402
from benchmarks.workloads import BenchRequest  # noqa: E402
from benchmarks.workloads.text import words  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_warm_restart.json"
VICTIM = 1  # the replica that restarts (r1)
WINDOW_S = 60.0  # "the minute after the restart", in simulated seconds
ROWS = ("warm-up off", "warm-up on")
# the gateway's real-time clocks, scaled by time_scale in the run (see the module docstring)
SCRAPE_S = 5.0
HEALTH_S = 5.0
WARMUP_RATE = 10.0  # replays per simulated second
WARMUP_COOLDOWN_S = 60.0


@dataclass(frozen=True)
class Spec:
    """The workload and clock of one run."""

    prefixes: int
    prefix_tokens: int
    rate: float  # requests per simulated second
    zipf: float
    before_s: float  # simulated seconds of traffic before the restart
    downtime_s: float  # simulated seconds the restarted replica answers 503
    time_scale: float
    max_tokens: int = 16
    seed: int = 0

    @property
    def span_s(self) -> float:
        return self.before_s + WINDOW_S


def build_requests(spec: Spec) -> list[BenchRequest]:
    """Poisson arrivals; each picks a document by Zipf popularity and asks a unique question."""
    rng = random.Random(spec.seed)
    docs = [
        f"Document {p}. Answer questions about it precisely." + words(random.Random(1000 + p), spec.prefix_tokens)
        for p in range(spec.prefixes)
    ]
    weights = [1.0 / (rank + 1) ** spec.zipf for rank in range(spec.prefixes)]
    order = list(range(spec.prefixes))
    rng.shuffle(order)  # popularity is not the document number (nor the ring position)
    out: list[BenchRequest] = []
    t = 0.0
    i = 0
    while True:
        t += rng.expovariate(spec.rate)
        if t >= spec.span_s:
            return out
        doc = order[rng.choices(range(spec.prefixes), weights)[0]]
        question = f"Question {i}:" + words(rng, 24)
        messages = [{"role": "system", "content": docs[doc]}, {"role": "user", "content": question}]
        out.append(BenchRequest(t, "chat", {"messages": messages}, spec.max_tokens, spec.prefix_tokens + 40))
        i += 1


def gateway_config(urls: Sequence[str], spec: Spec, warm: bool) -> dict[str, Any]:
    ts = spec.time_scale
    return {
        "server": {"host": "127.0.0.1", "port": 0},
        "logging": {"level": "info", "access_log": False, "summary_interval_s": 0},  # info: serve_gateway reads the URL
        "health": {"interval_s": HEALTH_S * ts, "timeout_s": 1.0},
        "scrape": {"interval_s": SCRAPE_S * ts, "timeout_s": 1.0},
        "replicas": [{"name": f"r{i}", "url": url} for i, url in enumerate(urls)],
        "routes": [{"name": "bench", "policy": "prefix"}],
        "warm_restart": {
            "enabled": warm,
            "max_replays": 256,
            "rate_per_s": WARMUP_RATE / ts,
            "cooldown_s": WARMUP_COOLDOWN_S * ts,
        },
    }


async def replay_with_restart(
    wire: Sequence[WireRequest], gateway_url: str, victim_url: str, spec: Spec, deadline_s: float
) -> tuple[list[Outcome], float]:
    """Replay ``wire`` and restart the victim replica at ``before_s``; returns (outcomes, restart time)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    body = json.dumps({"reset_metrics": True, "downtime_ms": spec.downtime_s * spec.time_scale * 1000}).encode()

    async def restart() -> float:
        await asyncio.sleep(spec.before_s * spec.time_scale)
        at = loop.time() - t0
        await asyncio.to_thread(bp.http_json, victim_url + "/sim/restart", body)
        return at

    names = [f"r{i}" for i in range(bp.REPLICAS)]
    result, restarted = await asyncio.gather(
        replay(wire, [gateway_url], deadline_s=deadline_s, replica_names=names), restart()
    )
    return result.outcomes, restarted


def window_stats(outcomes: Sequence[Outcome], start: float, end: float, replica: str | None = None) -> dict[str, Any]:
    """TTFT percentiles (wall ms) and hit rate of the requests sent in [start, end)."""
    sel = [o for o in outcomes if start <= o.sent < end and (replica is None or o.replica == replica)]
    ttft = [o.ttft * 1000 for o in sel if o.ttft is not None]
    ok = [o for o in sel if o.ok and o.prompt_tokens and o.cached_tokens is not None]
    prompt = sum(o.prompt_tokens or 0 for o in ok)
    return {
        "requests": len(sel),
        "errors": sum(1 for o in sel if not o.ok),
        "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_p90_ms": float(np.percentile(ttft, 90)) if ttft else None,
        "ttft_p99_ms": float(np.percentile(ttft, 99)) if ttft else None,
        "hit_rate": sum(o.cached_tokens or 0 for o in ok) / prompt if prompt else None,
        "cold_requests": sum(1 for o in ok if (o.cached_tokens or 0) < (o.prompt_tokens or 0) / 2),
    }


def warmup_counts(gateway_url: str) -> dict[str, float]:
    """The gateway's warm-up counters (``/metrics``), summed over replicas."""
    with urllib.request.urlopen(gateway_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    pattern = r"^prefix_gateway_(warmup_requests_total|replica_restarts_detected_total)\{([^}]*)\} (\S+)$"
    for name, labels, value in re.findall(pattern, text, re.M):
        key = re.search(r'(?:outcome|cause)="([^"]+)"', labels)
        label = f"{name.split('_total')[0]}:{key.group(1) if key else ''}"
        out[label] = out.get(label, 0.0) + float(value)
    return out


def run_row(warm: bool, wire: list[WireRequest], urls: list[str], spec: Spec, workdir: Path) -> dict[str, Any]:
    bp.reset_sims(urls)  # empty caches; counters keep counting (the restart below resets the victim's)
    config = gateway_config(urls, spec, warm)
    deadline = spec.span_s * spec.time_scale * bp.DEADLINE_FACTOR + bp.DEADLINE_SLACK_S
    with serve_gateway(config, workdir / f"gateway-{'on' if warm else 'off'}.log") as (url, _proc):
        bp.poll(url + "/ready", 60, "gateway")
        bp.warm_up(url)  # the gateway's tokenizer is loaded before the clock starts
        bp.reset_sims(urls)
        outcomes, restarted = asyncio.run(replay_with_restart(wire, url, urls[VICTIM], spec, deadline))
        counts = warmup_counts(url)
    window = WINDOW_S * spec.time_scale
    # the steady state just before: the second half of the stretch before the restart, at most 30 s
    before = (max(0.0, restarted - min(window, spec.before_s * spec.time_scale) / 2), restarted)
    victim = f"r{VICTIM}"
    return {
        "restart_at_s": restarted,
        "before": window_stats(outcomes, *before),
        "after": window_stats(outcomes, restarted, restarted + window),
        "before_restarted_replica": window_stats(outcomes, *before, replica=victim),
        "after_restarted_replica": window_stats(outcomes, restarted, restarted + window, replica=victim),
        "gateway": counts,
    }


def fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, pattern)


def pct(rate: float | None) -> float | None:
    return None if rate is None else 100 * rate


def scenario_name(downtime_s: float) -> str:
    return f"restart, {downtime_s:g} s down" if downtime_s else "restart, no downtime"


def table(results: dict[str, Any]) -> str:
    """Per scenario and row (medians over repetitions): the steady state before, the minute after."""
    head = (
        f"{'row':<13}{'window':<15}{'reqs':>6}{'hit %':>7}{'p50 ms':>8}{'p90 ms':>8}{'p99 ms':>8}"
        f"   {'r1 reqs':>7}{'r1 hit %':>9}{'r1 p90 ms':>10}{'r1 cold':>8}"
    )
    lines = []
    for name, scenario in results["scenarios"].items():
        lines += [f"== {name}", head]
        for row, r in scenario["rows"].items():
            for key, label in (("before", "before restart"), ("after", "minute after")):
                a, v = r[key], r[f"{key}_restarted_replica"]
                lines.append(
                    f"{row:<13}{label:<15}{a['requests']:>6}{fmt(pct(a['hit_rate']), '.1f'):>7}"
                    f"{fmt(a['ttft_p50_ms'], '.0f'):>8}{fmt(a['ttft_p90_ms'], '.0f'):>8}"
                    f"{fmt(a['ttft_p99_ms'], '.0f'):>8}"
                    f"   {v['requests']:>7}{fmt(pct(v['hit_rate']), '.1f'):>9}"
                    f"{fmt(v['ttft_p90_ms'], '.0f'):>10}{v['cold_requests']:>8}"
                )
            g = r["gateway"]
            lines.append(
                f"{'':<13}warm-up replays ok {g.get('warmup_requests:ok', 0):.0f}, failed "
                f"{g.get('warmup_requests:failed', 0):.0f}; restarts detected: counters reset "
                f"{g.get('replica_restarts_detected:counters_reset', 0):.0f}, rejoined "
                f"{g.get('replica_restarts_detected:rejoined', 0):.0f}"
            )
        off, on = (scenario["rows"][row] for row in ROWS)
        for label, key in (("all requests", "after"), ("restarted replica", "after_restarted_replica")):
            if off[key]["ttft_p90_ms"] and on[key]["ttft_p90_ms"]:
                ratio = on[key]["ttft_p90_ms"] / off[key]["ttft_p90_ms"]
                lines.append(f"TTFT p90 in the minute after, warm-up on / off, {label}: {ratio:.2f}")
        lines.append("")
    return "\n".join(lines)


def run_scenario(spec: Spec, urls: list[str], repeat: int, workdir: Path) -> dict[str, Any]:
    """Both rows ``repeat`` times (alternating, so a slow moment hits one run of each); medians."""
    wire = prepare(build_requests(spec), bp.MODEL, spec.time_scale)
    print(
        f"== {scenario_name(spec.downtime_s)}: {len(wire)} requests over {spec.span_s:.0f} simulated s "
        f"({spec.span_s * spec.time_scale:.0f} wall s), {spec.prefixes} documents of {spec.prefix_tokens} tokens, "
        f"r{VICTIM} restarts at {spec.before_s:.0f} s"
    )
    repeats: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    for rep in range(repeat):
        for row in ROWS:
            r = run_row(row.endswith("on"), wire, urls, spec, workdir)
            repeats[row].append(r)
            a, v = r["after"], r["after_restarted_replica"]
            print(
                f"  {row:<12} [{rep + 1}/{repeat}] minute after: TTFT p90 {fmt(a['ttft_p90_ms'], '.0f')} ms "
                f"(r{VICTIM}: {fmt(v['ttft_p90_ms'], '.0f')} ms, {v['cold_requests']} cold of {v['requests']}), "
                f"hit {fmt(pct(a['hit_rate']), '.1f')} %, replays {r['gateway'].get('warmup_requests:ok', 0):.0f}"
            )
    rows = {row: median_of_runs(runs) for row, runs in repeats.items()}
    return {"spec": spec.__dict__, "requests": len(wire), "rows": rows, "repeats": repeats}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a shorter steady state, faster clock, one run (< 2 min)")
    parser.add_argument("--prefixes", type=int, default=24, help="documents")
    parser.add_argument("--prefix-tokens", type=int, default=8000)
    parser.add_argument("--rate", type=float, default=12.0, help="requests per simulated second")
    parser.add_argument("--zipf", type=float, default=0.8)
    parser.add_argument("--before-s", type=float, default=None, help="simulated s before the restart (60, quick 30)")
    parser.add_argument(
        "--downtime-s",
        type=float,
        action="append",
        help="a scenario: simulated s the replica answers 503 after restarting (repeatable; default 0 and 20)",
    )
    parser.add_argument("--time-scale", type=float, default=None, help="wall s per simulated s (0.25, quick 0.2)")
    parser.add_argument("--repeat", type=int, default=None, help="runs per row; medians (default 3, quick 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    base = Spec(
        prefixes=args.prefixes,
        prefix_tokens=args.prefix_tokens,
        rate=args.rate,
        zipf=args.zipf,
        before_s=args.before_s if args.before_s is not None else (30.0 if args.quick else 60.0),
        downtime_s=0.0,
        time_scale=args.time_scale or (0.2 if args.quick else 0.25),
        seed=args.seed,
    )
    repeat = max(1, args.repeat or (1 if args.quick else 3))
    t_start = time.monotonic()
    results: dict[str, Any] = {
        "meta": {
            "command": " ".join(["python", "benchmarks/bench_warm_restart.py", *(argv or sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cpus": os.cpu_count(),
            "loadavg_start": [round(x, 1) for x in os.getloadavg()],
            "python": platform.python_version(),
            "git": bp._git_rev(),
            "replicas": bp.REPLICAS,
            "restarted_replica": f"r{VICTIM}",
            "sim": {k: bp.SIM[k] for k in ("num_gpu_blocks", "prefill_tokens_per_s", "decode_ms_per_token")},
            "window_s": WINDOW_S,
            "repeat": repeat,
            "gateway_clocks": {
                "scrape_s": SCRAPE_S,
                "health_s": HEALTH_S,
                "warmup_rate_per_s": WARMUP_RATE,
                "warmup_cooldown_s": WARMUP_COOLDOWN_S,
            },
            "units": "TTFT in wall-clock ms; windows in wall seconds = simulated seconds x time_scale",
        },
        "scenarios": {},
    }
    from gateway.sim.launcher import run_replicas

    with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
        sim = {**bp.SIM, "time_scale": base.time_scale}
        with run_replicas(bp.REPLICAS, log_dir=Path(tmp) / "sims", **sim) as urls:
            for downtime in args.downtime_s or [0.0, 20.0]:
                spec = dataclasses.replace(base, downtime_s=downtime)
                results["scenarios"][scenario_name(downtime)] = run_scenario(spec, urls, repeat, Path(tmp))
    results["meta"]["elapsed_s"] = round(time.monotonic() - t_start, 1)
    results["meta"]["loadavg_end"] = [round(x, 1) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + table(results))
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    print(f"total {results['meta']['elapsed_s']:.0f} s (load average {results['meta']['loadavg_end'][0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
