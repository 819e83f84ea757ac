"""Soak: unique prompt prefixes at full rate for N minutes; the gateway's RSS must level off.

    python benchmarks/bench_soak.py --minutes 10          # the issue's soak
    python benchmarks/bench_soak.py --minutes 2           # a short run

Every request carries a prefix no other request shares, so the prefix policy's affinity
index gains keys on every request until it is full and evicts from then on; token caches,
metrics and stats must not grow with the number of distinct prompts either.  One gateway
process (``prefix`` policy) over two instant simulated replicas, a closed loop of
``--concurrency`` clients (a quarter of the requests streaming), and every ``--sample``
seconds: the gateway's RSS (``/proc/<pid>/status`` VmRSS), requests served, errors, and the
affinity index's occupancy from ``/admin/stats``.  Verdict: RSS over the last half of the
run stays within ``--flat-mb`` of its first value there (flat once the index is full).
Results: a table on stdout and ``benchmarks/results/bench_soak.json``.
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
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.processes import serve_gateway  # noqa: E402
from gateway.sim import DEFAULT_MODEL  # noqa: E402
from gateway.sim.launcher import run_replicas  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_soak.json"
ADMIN_KEY = "soak-admin-" + uuid.uuid4().hex[:8]
FILLER = " ".join(f"w{i}" for i in range(200))  # ~400 tokens after the unique head: several blocks


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def affinity_keys(url: str) -> int | None:
    try:
        stats = httpx.get(f"{url}/admin/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5).json()
        return stats["routes"]["soak"]["policy_state"]["affinity"]["entries"]
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None


async def load(url: str, concurrency: int, stop_at: float, counts: dict[str, Any]) -> None:
    def note(what: str) -> None:
        kinds = counts.setdefault("error_kinds", {})
        kinds[what] = kinds.get(what, 0) + 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def worker(w: int) -> None:
            i = 0
            while time.monotonic() < stop_at:
                i += 1
                stream = i % 4 == 0
                body = {
                    "model": DEFAULT_MODEL,
                    "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} {w} {i} {FILLER}"}],
                    "max_tokens": 2,
                    "stream": stream,
                }
                try:
                    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                        data = await response.read()
                        if response.status == 200:
                            counts["ok"] += 1
                        else:
                            counts["errors"] += 1
                            note(f"{response.status} {data[:160]!r}")
                except aiohttp.ClientError as exc:
                    counts["errors"] += 1
                    note(type(exc).__name__)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))


def run(minutes: float, concurrency: int, sample_s: float, affinity_mb: float | None) -> dict[str, Any]:
    sim_options = {"time_scale": 0, "disable_uvicorn_access_log": True, "disable_log_stats": True}
    config = {
        "server": {"host": "127.0.0.1", "port": 0},
        "logging": {"summary_interval_s": 0, "access_log": False},
        "replicas": [],
        # No KV cache model: the default (replica_cache_tokens: auto) caps each replica's share at
        # what its engine holds, 8192 blocks x 16 tokens in these simulators, ~2,100 keys, full
        # within a second whatever --affinity-mb says; the soak is about the index's byte bound
        # (affinity_max_bytes), so only that bound may stop it growing.
        "routes": [{"name": "soak", "policy": "prefix", "policy_settings": {"replica_cache_tokens": None}}],
    }
    if affinity_mb is not None:  # a smaller index fills sooner: a short run shows the flat part too
        config["routes"][0]["policy_settings"]["affinity_max_bytes"] = int(affinity_mb * 1024 * 1024)
    os.environ["PREFIX_GATEWAY_ADMIN_KEY"] = ADMIN_KEY  # the gateway child inherits it
    samples: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp,
        run_replicas(2, log_dir=Path(tmp), **sim_options) as urls,
    ):
        config["replicas"] = [{"name": f"r{i}", "url": u} for i, u in enumerate(urls)]
        with serve_gateway(config, Path(tmp) / "gateway.log") as (url, proc):
            counts: dict[str, Any] = {"ok": 0, "errors": 0}
            t0 = time.monotonic()
            stop_at = t0 + minutes * 60

            async def main() -> None:
                task = asyncio.create_task(load(url, concurrency, stop_at, counts))
                last = (t0, 0)
                while not task.done():
                    await asyncio.sleep(sample_s)
                    now = time.monotonic()
                    done = counts["ok"] + counts["errors"]
                    keys = await asyncio.to_thread(affinity_keys, url)
                    samples.append(
                        {
                            "t_s": round(now - t0, 1),
                            "requests": done,
                            "rps": round((done - last[1]) / (now - last[0]), 1),
                            "errors": counts["errors"],
                            "rss_mb": round(rss_mb(proc.pid), 1),
                            "affinity_entries": keys,
                        }
                    )
                    last = (now, done)
                await task

            asyncio.run(main())
    half = [s["rss_mb"] for s in samples[len(samples) // 2 :]]
    return {
        "samples": samples,
        "requests": counts["ok"] + counts["errors"],
        "errors": counts["errors"],
        "error_kinds": counts.get("error_kinds", {}),
        "rss_start_mb": samples[0]["rss_mb"] if samples else None,
        "rss_end_mb": samples[-1]["rss_mb"] if samples else None,
        "rss_last_half_growth_mb": round(half[-1] - half[0], 1) if half else None,
        "rss_last_half_max_minus_min_mb": round(max(half) - min(half), 1) if half else None,
        "settings": {"minutes": minutes, "concurrency": concurrency, "sample_s": sample_s, "affinity_mb": affinity_mb},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{'t (s)':>7} {'requests':>9} {'req/s':>7} {'errors':>7} {'RSS MB':>7} {'affinity entries':>17}"]
    for s in result["samples"]:
        keys = "-" if s["affinity_entries"] is None else s["affinity_entries"]
        lines.append(f"{s['t_s']:>7} {s['requests']:>9} {s['rps']:>7} {s['errors']:>7} {s['rss_mb']:>7} {keys:>17}")
    lines.append(
        f"RSS {result['rss_start_mb']} -> {result['rss_end_mb']} MB; last half: growth "
        f"{result['rss_last_half_growth_mb']} MB, spread {result['rss_last_half_max_minus_min_mb']} MB; "
        f"{result['requests']} requests, {result['errors']} errors {result['error_kinds'] or ''}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--flat-mb", type=float, default=10.0, help="allowed RSS growth over the last half")
    parser.add_argument(
        "--affinity-mb", type=float, default=None, help="affinity index bound (default: the policy's 64 MiB)"
    )
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    result = run(args.minutes, args.concurrency, args.sample, args.affinity_mb)
    print(table(result))
    if not args.no_save:
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    flat = result["rss_last_half_growth_mb"] is not None and result["rss_last_half_growth_mb"] <= args.flat_mb
    ok = flat and result["errors"] == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
