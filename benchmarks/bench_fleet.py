"""Several gateway pods, measured: 1 gateway vs 3, with and without shared state (Redis).

    python benchmarks/bench_fleet.py --quick                  # smoke run: 2 workloads, small samples
    python benchmarks/bench_fleet.py                          # every workload, moderate load
    python benchmarks/bench_fleet.py --workload agent --size 0.5

Behind a Kubernetes Service each request of a conversation may reach a different gateway pod.
This replays the policy benchmark's workloads (``bench_policies.py``: its workloads, simulated
fleet, load levels and replay machinery, imported, not copied) through:

- ``1 gateway``: one ``prefix`` gateway (the reference);
- ``3 gateways``: three, each on its own state (``state.backend: memory``);
- ``3 gateways + redis``: three sharing affinity and load through Redis.

The client spreads requests over the gateways in turn (``replay``'s multi-URL mode), as a
Service spreads connections.  Targets (issue 10), for ``3 gateways + redis`` against
``1 gateway``: hit rate at most 1 point lower, TTFT p50 at most 1.2x, prefill-work balance
(max/mean over replicas) at most 1.25.  Redis: ``--redis-url`` (default
``$PREFIX_GATEWAY_TEST_REDIS_URL`` or 127.0.0.1:6379); when none answers, a ``redis-server``
child is started as the tests do (``tests/redis_server.py``).  Results: a table on stdout and
``benchmarks/results/bench_fleet.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from benchmarks import bench_policies as bp  # noqa: E402
from benchmarks.replay import prepare  # noqa: E402
from benchmarks.workloads import WORKLOAD_NAMES, build  # noqa: E402
from tests.redis_server import start_redis  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_fleet.json"
ROWS = ("1 gateway", "3 gateways", "3 gateways + redis")
TARGETS = {"hit_rate_loss_points": 1.0, "ttft_p50_ratio": 1.2, "balance": 1.25}
QUICK_WORKLOADS = ("agent", "mooncake_conversation")


def start_gateway(name: str, replicas: Sequence[tuple[str, str]], workdir: Path, state: dict[str, Any] | None) -> Any:
    """``bench_policies.start_gateway`` (a prefix gateway, quiet logs), with ``state:`` added to its config."""
    base = bp.gateway_config

    def with_state(replicas: Sequence[tuple[str, str]], variant: bp.Variant, port: int) -> dict[str, Any]:
        config = base(replicas, variant, port)
        return {**config, "state": state} if state is not None else config

    bp.gateway_config = with_state  # type: ignore[assignment]
    try:
        return bp.start_gateway(bp.Variant(name, "prefix", "relocate"), replicas, workdir)
    finally:
        bp.gateway_config = base  # type: ignore[assignment]


@contextmanager
def gateway_set(
    n: int, replicas: Sequence[tuple[str, str]], workdir: Path, state: dict[str, Any] | None, tag: str
) -> Iterator[list[str]]:
    """``n`` prefix gateways over the same replicas (optionally sharing ``state``); yields their URLs."""
    procs: list[Any] = []
    try:
        for i in range(n):
            procs.append(start_gateway(f"{tag}-{i}", replicas, workdir, state))
        for gw in procs:
            bp.poll(gw.url + "/ready", 60, f"gateway {gw.name}")
        yield [gw.url for gw in procs]
    finally:
        for gw in procs:
            gw.stop()


def row_numbers(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "hit_rate": summary.get("hit_rate"),
        "ttft_p50_ms": (summary.get("ttft_ms") or {}).get("p50"),
        "ttft_p90_ms": (summary.get("ttft_ms") or {}).get("p90"),
        "balance": (summary.get("prefill_work") or {}).get("max_over_mean"),
        "ok": summary.get("ok"),
        "errors": summary.get("errors"),
        "unfinished": summary.get("unfinished"),
    }


def run_workload(name: str, size: float, seed: int, redis_url: str, workdir: Path) -> dict[str, Any]:
    from gateway.sim.launcher import run_replicas

    wl = build(name, size=size, seed=seed)
    time_scale = bp.time_scale_for(wl, bp.SIM, bp.REPLICAS)
    factor = bp.time_factor_for(wl, bp.LOADS[wl.name]["moderate"], time_scale, bp.SIM, bp.REPLICAS)
    wire = prepare(wl.requests, bp.MODEL, factor)
    span = wire[-1].at if wire else 0.0
    deadline = span * bp.DEADLINE_FACTOR + bp.DEADLINE_SLACK_S
    print(f"\n== {name}: {len(wire)} requests over {span:.1f} s (moderate load, time_scale {time_scale})")
    out: dict[str, Any] = {"requests": len(wire), "span_s": span, "rows": {}}
    names = [f"r{i}" for i in range(bp.REPLICAS)]
    sim = {**bp.SIM, "time_scale": time_scale}
    with run_replicas(bp.REPLICAS, log_dir=workdir / f"sims-{name}", **sim) as urls:
        replicas = list(zip(names, urls, strict=True))
        for row in ROWS:
            n = 1 if row == "1 gateway" else 3
            state = None
            if row.endswith("redis"):
                state = {"backend": "redis", "redis_url": redis_url, "channel": f"bench-fleet-{uuid.uuid4().hex}"}
            tag = row.replace(" ", "_").replace("+", "")
            with gateway_set(n, replicas, workdir, state, tag) as gateway_urls:
                summary = bp.run_once(wire, gateway_urls, urls, names, deadline, via_gateway=True)
            out["rows"][row] = row_numbers(summary)
            r = out["rows"][row]
            print(
                f"  {row:<20} hit {100 * (r['hit_rate'] or 0):5.1f} %  ttft p50 {r['ttft_p50_ms'] or 0:7.0f} ms"
                f"  balance {r['balance'] or 0:4.2f}  ok {r['ok']} errors {r['errors']}"
            )
    ref, alone, shared = (out["rows"][r] for r in ROWS)
    out["verdict"] = verdict(ref, shared, alone)
    return out


def verdict(ref: dict[str, Any], shared: dict[str, Any], alone: dict[str, Any]) -> dict[str, Any]:
    def loss(row: dict[str, Any]) -> float | None:
        if ref["hit_rate"] is None or row["hit_rate"] is None:
            return None
        return round(100 * (ref["hit_rate"] - row["hit_rate"]), 2)

    ratio = shared["ttft_p50_ms"] / ref["ttft_p50_ms"] if ref["ttft_p50_ms"] and shared["ttft_p50_ms"] else None
    v = {
        "redis_hit_rate_loss_points": loss(shared),
        "no_sharing_hit_rate_loss_points": loss(alone),
        "redis_ttft_p50_ratio": round(ratio, 3) if ratio else None,
        "redis_balance": round(shared["balance"], 3) if shared["balance"] else None,
    }
    v["pass"] = {
        "hit_rate": v["redis_hit_rate_loss_points"] is not None
        and v["redis_hit_rate_loss_points"] <= TARGETS["hit_rate_loss_points"],
        "ttft_p50": ratio is not None and ratio <= TARGETS["ttft_p50_ratio"],
        "balance": v["redis_balance"] is not None and v["redis_balance"] <= TARGETS["balance"],
    }
    return v


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'workload':<24}{'row':<22}{'hit %':>7}{'ttft p50 ms':>13}{'p90 ms':>9}{'balance':>9}{'errors':>8}",
    ]
    for name, wres in results["workloads"].items():
        for row, r in wres["rows"].items():
            lines.append(
                f"{name:<24}{row:<22}{100 * (r['hit_rate'] or 0):>7.1f}{r['ttft_p50_ms'] or 0:>13.0f}"
                f"{r['ttft_p90_ms'] or 0:>9.0f}{r['balance'] or 0:>9.2f}{r['errors']:>8}"
            )
        v = wres["verdict"]
        lines.append(
            f"{'':<24}redis vs 1 gateway: hit loss {v['redis_hit_rate_loss_points']} pts (target <= 1, "
            f"{'PASS' if v['pass']['hit_rate'] else 'FAIL'}), ttft p50 x{v['redis_ttft_p50_ratio']} (<= 1.2, "
            f"{'PASS' if v['pass']['ttft_p50'] else 'FAIL'}), balance {v['redis_balance']} (<= 1.25, "
            f"{'PASS' if v['pass']['balance'] else 'FAIL'}); "
            f"without sharing: hit loss {v['no_sharing_hit_rate_loss_points']} pts"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_WORKLOADS)} at size 0.3")
    parser.add_argument("--workload", action="append", choices=WORKLOAD_NAMES)
    parser.add_argument("--size", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args(argv)
    workloads = args.workload or (list(QUICK_WORKLOADS) if args.quick else list(WORKLOAD_NAMES))
    size = args.size if args.size is not None else (bp.QUICK_SIZE if args.quick else 1.0)
    t0 = time.monotonic()
    redis = start_redis(args.redis_url)
    if redis.url is None:
        print(f"no Redis: {redis.reason}")
        return 2
    results: dict[str, Any] = {
        "meta": {
            "command": " ".join(["python", "benchmarks/bench_fleet.py", *(argv or sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "size": size,
            "seed": args.seed,
            "load": "moderate",
            "replicas": bp.REPLICAS,
            "redis": redis.reason,
            "client": "requests spread over the gateways in turn",
        },
        "targets": TARGETS,
        "workloads": {},
    }
    try:
        with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
            for name in workloads:
                results["workloads"][name] = run_workload(name, size, args.seed, redis.url, Path(tmp))
    finally:
        redis.stop()
    results["meta"]["elapsed_s"] = round(time.monotonic() - t0, 1)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print("\n" + table(results))
    print(f"\nwrote {RESULTS.relative_to(ROOT)} in {results['meta']['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
