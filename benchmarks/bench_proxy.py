"""The gateway's own cost: added latency, peak throughput and stream gaps, gateway vs direct.

    python benchmarks/bench_proxy.py                # ~1.5 min, every phase
    python benchmarks/bench_proxy.py --quick        # ~30 s smoke run
    python benchmarks/bench_proxy.py --profile      # also py-spy the gateway during the peak phase
    python benchmarks/bench_proxy.py --out /tmp/p   # results elsewhere (a folder)

Everything is measured in one run, as gateway-vs-direct pairs against the same simulator:

1. **added latency** — open loop at a fixed rate (300 req/s), small non-streaming chat
   requests; direct and through the gateway in alternating rounds.  Added = gateway - direct
   at p50 and p99.  (Targets: p50 <= 1 ms, p99 <= 5 ms.)
2. **peak throughput** — closed loop, N connections, small requests, non-streaming and
   streaming (16 chunks, instant replica).  (Target: >= 1,000 req/s non-streaming.)
3. **stream gaps** — a real-time replica (20 ms per token): the gaps between chunk arrivals
   at the client, and TTFT, direct vs gateway.  (Target: gaps within 1 ms of direct.)

Processes: the replicas (``gateway.sim``, own processes), one gateway process
(``prefix-gateway serve`` with a default config: access log and summary line on, logs to
a temp file), and this process as the load generator (aiohttp on uvloop).  On a 2-core
machine they share the CPU, and other work on the machine adds noise: read the ratios, not
the absolute numbers.  Results: a table on stdout and ``bench_proxy.json`` (and, with
``--profile``, ``bench_proxy_profile.txt``) in ``--out`` (default ``benchmarks/results/``).
Errors: every phase counts the non-200 answers and failed requests of its timed part (never
its warm-up's) and leaves them out of the latencies, gaps and TTFTs.  A failed warm-up request
does not end the warm-up: every phase counts them apart (``*_warmup_errors`` in the JSON, and a
``warm-up errors`` line under the table).  A closed-loop connection backs off after an error
(1 ms, doubling, at most 100 ms; reset by a success) instead of retrying at once.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.processes import serve_gateway  # noqa: E402
from benchmarks.procstat import cpu_seconds  # noqa: E402
from gateway.sim import DEFAULT_MODEL  # noqa: E402
from gateway.sim.launcher import run_replicas  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"  # the default --out: bench_proxy.json (and the profile) go here
SMALL_CHAT = {
    "model": DEFAULT_MODEL,
    "messages": [{"role": "user", "content": "Hello! Can you tell me a short fact about the sea?"}],
    "max_tokens": 16,
}
TARGETS = {"added_p50_ms": 1.0, "added_p99_ms": 5.0, "peak_rps": 1000.0, "gap_delta_ms": 1.0}
BACKOFF_FIRST_S, BACKOFF_CAP_S = 0.001, 0.1  # a closed-loop connection's pause after 1, 2, ... errors in a row


# -- processes ---------------------------------------------------------------------------------


@contextmanager
def gateway_process(replica_url: str, log_path: Path) -> Iterator[tuple[str, int]]:
    """``prefix-gateway serve`` on a free port over one replica; yields (base URL, pid)."""
    config = {
        "server": {"host": "127.0.0.1", "port": 0},
        "replicas": [{"name": "r0", "url": replica_url}],
        "routes": [{"name": "bench", "match": {"models": [DEFAULT_MODEL]}, "policy": "least_loaded"}],
    }
    with serve_gateway(config, log_path) as (url, proc):
        yield url, proc.pid


# -- load --------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> float:
    start = time.perf_counter()
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
        if stream:
            async for _ in resp.content.iter_any():
                pass
        else:
            await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
    return time.perf_counter() - start


async def open_loop(url: str, body: bytes, rate: float, duration: float) -> dict[str, Any]:
    """Requests at fixed intervals regardless of answers (no coordinated omission)."""
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def fire() -> None:
            nonlocal errors
            try:
                latencies.append(await _one(session, url, body, False))
            except Exception:
                errors += 1

        for _ in range(20):  # warm the connection pool
            await fire()
        warmup_errors, errors = errors, 0  # the timed run's errors only, like its latencies
        latencies.clear()
        n = int(rate * duration)
        start = time.perf_counter()
        tasks = []
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire()))
        await asyncio.gather(*tasks)
    return {"latencies": latencies, "errors": errors, "warmup_errors": warmup_errors}


def backoff_s(failures: int) -> float:
    """The pause after ``failures`` (>= 1) errors in a row on one closed-loop connection.

    Retrying at once made a replica that refuses instantly spin every connection until its
    deadline: thousands of errors a second that measure nothing and take the CPU the gateway
    and the replica are measured on.  Doubling from 1 ms keeps a lone error nearly free (the
    connection is back within a millisecond); the 100 ms cap gives a replica that recovers its
    load back within a tenth of a second.
    """
    return min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2 ** (failures - 1))


async def closed_loop(url: str, body: bytes, concurrency: int, duration: float, stream: bool) -> dict[str, Any]:
    """``concurrency`` connections, each sending its next request when its last one is answered."""
    latencies: list[float] = []
    warm: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def connection(stop_at: float, served: list[float]) -> int:
            """Requests back to back until ``stop_at``, the latency of each served one into ``served``;
            returns how many failed (each one sent, so the count is of real requests, not retries).
            After an error it backs off (``backoff_s``) and goes on: in the warm-up one error must
            neither end it early (the timed part would start cold) nor count as a timed one.  A pause
            that reaches ``stop_at`` ends the connection there (a timer may fire a little early, and
            one more request just before the deadline would be a retry the schedule never allowed).
            A success resets the back-off, and an error-free run never pauses."""
            errors = failures = 0
            while time.perf_counter() < stop_at:
                try:
                    served.append(await _one(session, url, body, stream))
                    failures = 0
                except Exception:
                    errors += 1
                    failures += 1
                    pause, left = backoff_s(failures), stop_at - time.perf_counter()
                    await asyncio.sleep(max(0.0, min(pause, left)))
                    if pause >= left:
                        break
            return errors

        warm_until = time.perf_counter() + min(1.0, duration / 4)
        warmup_errors = sum(await asyncio.gather(*(connection(warm_until, warm) for _ in range(concurrency))))
        start = time.perf_counter()
        errors = sum(await asyncio.gather(*(connection(start + duration, latencies) for _ in range(concurrency))))
        elapsed = time.perf_counter() - start
    return {
        "rps": len(latencies) / elapsed,
        "latencies": latencies,
        "errors": errors,
        "seconds": elapsed,
        "warmup_requests": len(warm),  # served ones; the failed ones are warmup_errors
        "warmup_errors": warmup_errors,
    }


async def stream_gaps(url: str, body: bytes, streams: int, concurrency: int) -> dict[str, Any]:
    """Chunk inter-arrival gaps and TTFT of real-time streams.  A non-200 answer is an error, its
    body no first chunk; so is a failed connection (refused, closed before the headers, or cut
    mid-stream), and the chunks such a stream got before it broke are not timed either."""
    gaps: list[float] = []
    ttfts: list[float] = []
    errors = 0
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:

        async def one() -> None:
            nonlocal errors
            async with sem:
                start = time.perf_counter()
                first: float | None = None  # this stream's TTFT and gaps, kept only if it ends well
                mine: list[float] = []
                last = None
                ok = False
                try:
                    async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
                        if resp.status != 200:
                            await resp.read()
                        else:
                            async for _ in resp.content.iter_any():
                                now = time.perf_counter()
                                if last is None:
                                    first = now - start
                                else:
                                    mine.append(now - last)
                                last = now
                            ok = True
                except (aiohttp.ClientError, OSError):  # OSError: TimeoutError and a refused connect too
                    ok = False
                if not ok:
                    errors += 1
                    return
                if first is not None:
                    ttfts.append(first)
                gaps.extend(mine)

        await asyncio.gather(*(one() for _ in range(streams)))
    return {"gaps": gaps, "ttfts": ttfts, "errors": errors}


def run_async(coro: Any) -> Any:
    import uvloop

    return uvloop.run(coro)


# -- phases ------------------------------------------------------------------------------------
def ms(value: float) -> float:
    return round(value * 1000, 3)


def phase_added_latency(direct: str, through: str, rate: float, duration: float, rounds: int) -> dict[str, Any]:
    """Alternate short direct/gateway rounds; report pooled percentiles and the median round.

    On a shared machine one descheduled timeslice (tens of ms) lands in somebody's p99; the
    median over rounds of (gateway p99 - direct p99) is the robust number, the pooled one is
    shown too.  Each side's warm-up errors are summed over the rounds and kept apart (like the
    peak rows'): a failed warm-up means that round's timed part may have started cold.
    """
    body = json.dumps(SMALL_CHAT).encode()
    pooled: dict[str, list[float]] = collections.defaultdict(list)
    per_round: list[dict[str, float]] = []
    errors = 0
    warmup_errors = {"direct": 0, "gateway": 0}
    for _ in range(rounds):
        this: dict[str, list[float]] = {}
        for name, base in (("direct", direct), ("gateway", through)):
            result = run_async(open_loop(base + "/v1/chat/completions", body, rate, duration))
            this[name] = result["latencies"]
            pooled[name] += result["latencies"]
            errors += result["errors"]
            warmup_errors[name] += result["warmup_errors"]
        per_round.append(
            {
                "added_p50_ms": ms(pct(this["gateway"], 0.5) - pct(this["direct"], 0.5)),
                "added_p99_ms": ms(pct(this["gateway"], 0.99) - pct(this["direct"], 0.99)),
            }
        )
    d, g = pooled["direct"], pooled["gateway"]

    def median(key: str) -> float:
        values = sorted(r[key] for r in per_round)
        return values[len(values) // 2]

    return {
        "rate": rate,
        "rounds": rounds,
        "requests_each": len(d),
        "errors": errors,
        "direct_warmup_errors": warmup_errors["direct"],
        "gateway_warmup_errors": warmup_errors["gateway"],
        "direct_p50_ms": ms(pct(d, 0.5)),
        "direct_p99_ms": ms(pct(d, 0.99)),
        "gateway_p50_ms": ms(pct(g, 0.5)),
        "gateway_p99_ms": ms(pct(g, 0.99)),
        "pooled_added_p50_ms": ms(pct(g, 0.5) - pct(d, 0.5)),
        "pooled_added_p99_ms": ms(pct(g, 0.99) - pct(d, 0.99)),
        "added_p50_ms": median("added_p50_ms"),
        "added_p99_ms": median("added_p99_ms"),
        "per_round": per_round,
    }


def phase_peak(
    direct: str, through: str, gateway_pid: int, concurrency: int, duration: float, stream: bool
) -> dict[str, Any]:
    body = json.dumps({**SMALL_CHAT, "stream": stream}).encode()
    out: dict[str, Any] = {"concurrency": concurrency, "stream": stream}
    for name, base in (("direct", direct), ("gateway", through)):
        cpu0, wall0 = cpu_seconds(gateway_pid), time.perf_counter()
        result = run_async(closed_loop(base + "/v1/chat/completions", body, concurrency, duration, stream))
        wall = time.perf_counter() - wall0
        out[f"{name}_rps"] = round(result["rps"], 1)
        out[f"{name}_p50_ms"] = ms(pct(result["latencies"], 0.5))
        out[f"{name}_p99_ms"] = ms(pct(result["latencies"], 0.99))
        out[f"{name}_errors"] = result["errors"]
        out[f"{name}_warmup_errors"] = result["warmup_errors"]  # apart: never in the timed figures
        if name == "gateway":
            cpu = cpu_seconds(gateway_pid) - cpu0
            out["gateway_cpu_pct"] = round(cpu / wall * 100, 1)
            # CPU time per request is robust to a busy machine: it bounds one process's ceiling.
            served = len(result["latencies"]) + result["warmup_requests"]
            out["gateway_cpu_us_per_req"] = round(cpu / served * 1e6, 1) if served else None
            out["gateway_ceiling_rps"] = round(1e6 / out["gateway_cpu_us_per_req"]) if served and cpu else None
    out["ratio"] = round(out["gateway_rps"] / out["direct_rps"], 3) if out["direct_rps"] else None
    return out


def phase_stream_gaps(direct: str, through: str, streams: int, concurrency: int, tokens: int) -> dict[str, Any]:
    body = json.dumps({**SMALL_CHAT, "max_tokens": tokens, "stream": True}).encode()
    out: dict[str, Any] = {"streams": streams, "concurrency": concurrency, "tokens": tokens}
    for name, base in (("direct", direct), ("gateway", through)):
        warm = run_async(stream_gaps(base + "/v1/chat/completions", body, concurrency, concurrency))
        result = run_async(stream_gaps(base + "/v1/chat/completions", body, streams, concurrency))
        gaps, ttfts = result["gaps"], result["ttfts"]
        out[f"{name}_gap_p50_ms"] = ms(pct(gaps, 0.5))
        out[f"{name}_gap_p99_ms"] = ms(pct(gaps, 0.99))
        out[f"{name}_ttft_p50_ms"] = ms(pct(ttfts, 0.5))
        out[f"{name}_chunks"] = len(gaps) + len(ttfts)
        out[f"{name}_errors"] = result["errors"]
        out[f"{name}_warmup_errors"] = warm["errors"]  # apart, like the other phases'
    out["gap_delta_p50_ms"] = round(out["gateway_gap_p50_ms"] - out["direct_gap_p50_ms"], 3)
    out["gap_delta_p99_ms"] = round(out["gateway_gap_p99_ms"] - out["direct_gap_p99_ms"], 3)
    out["ttft_delta_p50_ms"] = round(out["gateway_ttft_p50_ms"] - out["direct_ttft_p50_ms"], 3)
    return out


def profile_gateway(pid: int, seconds: float, through: str, concurrency: int, profile: Path) -> list[tuple[str, float]]:
    """py-spy the gateway under peak load into ``profile``; return the top functions by own (self) samples."""
    raw = profile.with_suffix(".raw")
    spy = subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--format", "raw", "-o", str(raw),
         "--nonblocking", "--rate", "250"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(0.5)  # py-spy attaches
    body = json.dumps(SMALL_CHAT).encode()
    run_async(closed_loop(through + "/v1/chat/completions", body, concurrency, seconds - 2, False))
    spy.wait(60)
    self_samples: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines() if raw.exists() else []:
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        total += int(count)
        self_samples[frames[-1]] += int(count)
    by_module: collections.Counter[str] = collections.Counter()
    for frame, count in self_samples.items():
        match = re.search(r"\((.*?)(?::\d+)?\)$", frame)
        path = match.group(1) if match else frame
        by_module[re.sub(r".*site-packages/", "", re.sub(r".*/gateway/", "gateway/", path))] += count
    lines = [f"py-spy: {total} samples over {seconds:.0f}s of peak load (c={concurrency})", "", "top functions (self):"]
    lines += [f"{count / total * 100:6.2f}%  {frame}" for frame, count in self_samples.most_common(30)]
    lines += ["", "by file (self):"]
    lines += [f"{count / total * 100:6.2f}%  {path}" for path, count in by_module.most_common(20)]
    profile.write_text("\n".join(lines) + "\n")
    raw.unlink(missing_ok=True)
    return [(frame, round(count / total * 100, 2)) for frame, count in self_samples.most_common(15)] if total else []


# -- report ------------------------------------------------------------------------------------
def table(results: dict[str, Any]) -> str:
    a = results["added_latency"]
    rows = [
        (f"non-stream @{a['rate']:.0f} req/s: p50 latency", a["direct_p50_ms"], a["gateway_p50_ms"], a["added_p50_ms"],
         f"added <= {TARGETS['added_p50_ms']} ms (median of {a['rounds']} rounds; pooled {a['pooled_added_p50_ms']})"),
        (f"non-stream @{a['rate']:.0f} req/s: p99 latency", a["direct_p99_ms"], a["gateway_p99_ms"], a["added_p99_ms"],
         f"added <= {TARGETS['added_p99_ms']} ms (median of {a['rounds']} rounds; pooled {a['pooled_added_p99_ms']})"),
    ]  # fmt: skip
    for peak in results["peak"]:
        kind = "stream" if peak["stream"] else "non-stream"
        rows.append(
            (f"{kind} peak req/s (c={peak['concurrency']})", peak["direct_rps"], peak["gateway_rps"],
             f"x{peak['ratio']}", f">= {TARGETS['peak_rps']:.0f} req/s" if not peak["stream"] else ""),
        )  # fmt: skip
        rows.append(
            (f"{kind} p50 latency (c={peak['concurrency']})", peak["direct_p50_ms"], peak["gateway_p50_ms"],
             round(peak["gateway_p50_ms"] - peak["direct_p50_ms"], 3),
             f"gw CPU {peak['gateway_cpu_pct']}%, {peak['gateway_cpu_us_per_req']} us/req "
             f"(1-core ceiling ~{peak['gateway_ceiling_rps']} req/s)"),
        )  # fmt: skip
    g = results["stream_gaps"]
    rows += [
        ("stream inter-chunk gap p50 (ms)", g["direct_gap_p50_ms"], g["gateway_gap_p50_ms"], g["gap_delta_p50_ms"],
         f"within {TARGETS['gap_delta_ms']} ms"),
        ("stream inter-chunk gap p99 (ms)", g["direct_gap_p99_ms"], g["gateway_gap_p99_ms"], g["gap_delta_p99_ms"],
         f"within {TARGETS['gap_delta_ms']} ms"),
        ("stream TTFT p50 (ms)", g["direct_ttft_p50_ms"], g["gateway_ttft_p50_ms"], g["ttft_delta_p50_ms"], ""),
    ]  # fmt: skip
    out = [f"| {'measure':<44} | {'direct':>10} | {'gateway':>10} | {'delta':>9} | target / note",
           f"|{'-' * 46}|{'-' * 12}|{'-' * 12}|{'-' * 11}|{'-' * 24}"]  # fmt: skip
    for name, d, gw, delta, note in rows:
        out.append(f"| {name:<44} | {d:>10} | {gw:>10} | {delta!s:>9} | {note}")
    return "\n".join([*out, "", warmup_note(results)])


def warmup_note(results: dict[str, Any]) -> str:
    """The line under the table naming every phase side whose warm-up had errors (or ``none``).

    The timed figures leave warm-up errors out, so a table read alone hid a warm-up that failed:
    that side's timed part may have started cold, or against a replica that was failing.
    """
    phases = [("added latency", results["added_latency"])]
    phases += [(f"{'stream' if p['stream'] else 'non-stream'} peak c={p['concurrency']}", p) for p in results["peak"]]
    phases.append(("stream gaps", results["stream_gaps"]))
    failed = [
        f"{label}: direct {row['direct_warmup_errors']}, gateway {row['gateway_warmup_errors']}"
        for label, row in phases
        if row["direct_warmup_errors"] or row["gateway_warmup_errors"]
    ]
    return "warm-up errors (not in the timed figures): " + ("; ".join(failed) if failed else "none")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases (smoke run)")
    parser.add_argument("--rate", type=float, default=300.0, help="open-loop rate for the added-latency phase")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64], help="closed-loop connections")
    parser.add_argument("--profile", action="store_true", help="py-spy the gateway during a peak phase")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="folder for bench_proxy.json (and bench_proxy_profile.txt)"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path, profile = args.out / "bench_proxy.json", args.out / "bench_proxy_profile.txt"
    duration, rounds, streams = (3.0, 3, 16) if args.quick else (5.0, 7, 48)

    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_before": os.getloadavg()},
        "targets": TARGETS,
    }
    with tempfile.TemporaryDirectory() as logs:
        quiet = {"disable_uvicorn_access_log": True, "disable_log_stats": True}
        with (
            run_replicas(1, time_scale=0, log_dir=Path(logs) / "instant", **quiet) as (instant,),
            run_replicas(1, time_scale=1.0, decode_ms_per_token=20, log_dir=Path(logs) / "rt", **quiet) as (realtime,),
            gateway_process(instant, Path(logs) / "gw-instant.log") as (gw_instant, pid),
            gateway_process(realtime, Path(logs) / "gw-rt.log") as (gw_realtime, _),
        ):
            print(f"replicas: instant {instant}, real-time {realtime}; gateways {gw_instant}, {gw_realtime}")
            print(f"[1/3] added latency: open loop {args.rate:.0f} req/s, {rounds}x{duration / 2:.1f}s each side ...")
            # short alternating rounds: direct and gateway see the same background noise
            results["added_latency"] = phase_added_latency(instant, gw_instant, args.rate, duration / 2, rounds)
            print("[2/3] peak throughput (closed loop) ...")
            results["peak"] = [
                phase_peak(instant, gw_instant, pid, c, duration, stream)
                for stream in (False, True)
                for c in args.concurrency
            ]
            print(f"[3/3] stream gaps: {streams} real-time streams of 64 tokens ...")
            results["stream_gaps"] = phase_stream_gaps(realtime, gw_realtime, streams, 8, 64)
            if args.profile:
                print("[+] profiling the gateway with py-spy ...")
                results["profile_top"] = profile_gateway(pid, 10.0, gw_instant, max(args.concurrency), profile)
        results["machine"]["load_after"] = os.getloadavg()
    print()
    print(table(results))
    path.write_text(json.dumps(results, indent=2) + "\n")
    shown = [path, profile] if args.profile else [path]
    print("\nwrote " + " and ".join(str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p) for p in shown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
