"""Tenant isolation under saturation, as ratios in one run: what the gateway's flow control buys a
quiet tenant and a high-priority band, and how much of their wait is the engine's own step.

    python benchmarks/bench_flow_isolation.py              # 3 runs per row, medians (~3 minutes)
    python benchmarks/bench_flow_isolation.py --repeat 1   # one run per row (~1 minute)
    python benchmarks/bench_flow_isolation.py --max-num-batched-tokens 128   # the engines' step budget

The setup of issue 26's ratio tests (``tests/flow/test_flow_ratios.py``, which measure with the
functions below): two simulated replicas in real time with four sequences each (the engine's
``max_num_seqs``), decoding 10 ms a step, prefilling 5,000 tokens a second; the official
``openai`` SDK as client; every measurement sends prompts of its own (no cache hits between
them).  A flood tenant sends 40 requests a second (more than the fleet serves) for 4 s with a
quiet tenant's request every 10th; then the same flood with every 10th request in a
high-priority band instead.

Rows (each a fresh gateway in front of the same replicas, drained between measurements):

- ``off``: flow control disabled; every request waits in an engine's FCFS queue.
- ``held``: flow control saturating at the engines' four sequences (the ratio tests' settings):
  requests wait at the gateway, where bands and fairness order them, and the engines' queues
  stay empty.
- ``free seat``: saturating at three: a seat on every replica is always free for the next
  request to leave the gateway.  Not a setting to ship (the flood loses a quarter of its
  seats): it is the floor of any holding at the gateway, since what remains of a quiet
  request's wait is the engine's step under way and a prefill step it shares.

Per row: the idle TTFT p90 (one request at a time on the idle fleet, after six unmeasured
ones), the quiet tenant's TTFT p90 under the flood and the high band's (both also as a ratio
to the idle p90 measured by the same gateway), and the flood requests completed within the
window (and as a ratio to ``off``'s in the same run).  Issue 26's targets: quiet <= 2x idle,
high band <= 1.5x idle, flood >= 0.9x ``off``.  Results: a table on stdout and
``benchmarks/results/bench_flow_isolation.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.http.server import RunningGateway, serve_in_thread  # noqa: E402
from gateway.sim.launcher import run_replicas  # noqa: E402
from tests.configs import gateway_config  # noqa: E402
from tests.polling import wait_for  # noqa: E402

MODEL = "demo-model"
SEQS = 4
SIM: dict[str, Any] = {
    "time_scale": 1.0,
    "max_num_seqs": SEQS,
    "decode_ms_per_token": 10.0,
    "prefill_tokens_per_s": 5000.0,
    "max_output_tokens": 64,
    "num_gpu_blocks": 8192,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}
SIGNALS_OFF = {"queued_prefill_tokens": 0, "waiting": 0, "kv_cache_usage": 0, "scrape_stale_s": 0}
SATURATION = {"in_flight": SEQS, **SIGNALS_OFF}  # held at the engines' sequences, nothing else
FREE_SEAT = {"in_flight": SEQS - 1, **SIGNALS_OFF}
FLOOD_RATE = 40.0  # req/s: over what the fleet serves at 20 tokens each
WINDOW_S = 4.0
FLOOD_TOKENS = 20
QUIET_EVERY = 10  # one quiet request per this many flood requests
FAIRNESS = "x-llm-d-inference-fairness-id"
OBJECTIVE = "x-llm-d-inference-objective"
OBJECTIVES = {"interactive": 10}

_RUNS = itertools.count()  # each measurement's prompts are its own


def prompt(tag: str, i: int, words: int) -> list[dict[str, str]]:
    """A chat prompt distinct from its first word: no prefix-cache hits blur a comparison, also
    none from an earlier measurement on the same replicas (``tag`` carries the run's number)."""
    return [{"role": "user", "content": f"{tag} {i} " + " ".join(f"w{i}x{k}" for k in range(words))}]


async def ttft(client: Any, messages: list[dict[str, str]], max_tokens: int, **headers: str) -> float:
    """Seconds to the first streamed chunk."""
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, stream=True, extra_headers=headers or None
    )
    first = None
    async for _chunk in stream:
        if first is None:
            first = time.perf_counter() - t0
    assert first is not None
    return first


def p90(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


async def idle_ttfts(gw: RunningGateway, n: int = 12, warm: int = 6) -> list[float]:
    """TTFTs one at a time on the idle fleet, after ``warm`` unmeasured ones (a fresh gateway's
    and replicas' first requests run slow: counted, they doubled the idle p90 the ratios divide by)."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=gw.openai_base_url, api_key="unused", max_retries=0, timeout=60) as client:
        run = next(_RUNS)
        ttfts = [await ttft(client, prompt(f"idle{run}", i, 60), 4) for i in range(warm + n)]
        return ttfts[warm:]


async def flooded(gw: RunningGateway, quiet: dict[str, str], flood: dict[str, str]) -> tuple[list[float], int]:
    """Open-loop flood at FLOOD_RATE for WINDOW_S with a quiet request every QUIET_EVERY:
    (the quiet requests' TTFTs, flood requests completed within the window)."""
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    http = httpx.AsyncClient(limits=limits, timeout=60)
    async with AsyncOpenAI(
        base_url=gw.openai_base_url, api_key="unused", max_retries=0, timeout=60, http_client=http
    ) as client:
        run = next(_RUNS)
        t0 = time.perf_counter()
        done_in_window = 0

        async def one_flood(i: int) -> None:
            nonlocal done_in_window
            await client.chat.completions.create(
                model=MODEL, messages=prompt(f"flood{run}", i, 60), max_tokens=FLOOD_TOKENS, extra_headers=flood
            )
            if time.perf_counter() - t0 <= WINDOW_S:
                done_in_window += 1

        tasks, quiet_tasks = [], []
        i = 0
        while (now := time.perf_counter() - t0) < WINDOW_S:
            tasks.append(asyncio.create_task(one_flood(i)))
            if i % QUIET_EVERY == QUIET_EVERY // 2 and now > 0.5:  # once the flood is under way
                quiet_tasks.append(asyncio.create_task(ttft(client, prompt(f"quiet{run}", i, 60), 4, **quiet)))
            i += 1
            await asyncio.sleep(max(0.0, i / FLOOD_RATE - (time.perf_counter() - t0)))
        quiet_ttfts = await asyncio.gather(*quiet_tasks)
        await asyncio.gather(*tasks)
    return list(quiet_ttfts), done_in_window


def drained(fleet: Sequence[str]) -> None:
    """Until no replica runs or queues anything (the next measurement starts on an idle fleet)."""

    def idle() -> bool:
        for url in fleet:
            text = httpx.get(f"{url}/metrics", timeout=5).text
            for line in text.splitlines():
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")) and not line.endswith(
                    " 0.0"
                ):
                    return False
        return True

    wait_for(idle, timeout=60, what="the fleet to drain")


def held_count(gw: RunningGateway) -> int:
    """Requests the route's flow control queued so far (0 with flow control off)."""
    route = gw.gateway.flow.routes.get("main")
    return int(route.totals["queued"]) if route is not None else 0


# -- the benchmark -----------------------------------------------------------------------------
ROWS: dict[str, dict[str, Any]] = {
    "off": {"enabled": False},
    "held": {"enabled": True, "saturation": SATURATION, "objectives": OBJECTIVES},
    "free seat": {"enabled": True, "saturation": FREE_SEAT, "objectives": OBJECTIVES},
}


def measure_row(fleet: Sequence[str], flow_control: dict[str, Any]) -> dict[str, Any]:
    """One row's run: idle p90, then the two-tenant flood, then the banded flood (ms, counts)."""
    with serve_in_thread(gateway_config(fleet, flow_control=flow_control)) as gw:
        idle = asyncio.run(idle_ttfts(gw))
        quiet, flood_done = asyncio.run(flooded(gw, {FAIRNESS: "quiet"}, {FAIRNESS: "flood"}))
        drained(fleet)
        high, _ = asyncio.run(flooded(gw, {OBJECTIVE: "interactive"}, {}))
        held = held_count(gw)
    drained(fleet)
    return {
        "idle_p90_ms": 1000 * p90(idle),
        "quiet_p90_ms": 1000 * p90(quiet),
        "high_p90_ms": 1000 * p90(high),
        "flood_done": flood_done,
        "held": held,
    }


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Medians per row of each figure and of each run's own ratios (to its idle p90, to ``off``)."""
    out: dict[str, dict[str, float]] = {}
    off = runs.get("off", [])
    for row, cells in runs.items():
        med = {key: statistics.median(c[key] for c in cells) for key in cells[0]}
        med["quiet_x_idle"] = statistics.median(c["quiet_p90_ms"] / c["idle_p90_ms"] for c in cells)
        med["high_x_idle"] = statistics.median(c["high_p90_ms"] / c["idle_p90_ms"] for c in cells)
        if off:
            med["flood_x_off"] = statistics.median(
                c["flood_done"] / max(1, o["flood_done"]) for c, o in zip(cells, off, strict=False)
            )
        out[row] = med
    return out


def table(summary: dict[str, dict[str, float]]) -> str:
    lines = [
        "| row | idle p90 ms | quiet p90 ms (x idle) | high band p90 ms (x idle) | flood done (x off) | held |",
        "|---|---|---|---|---|---|",
    ]
    for row, m in summary.items():
        lines.append(
            f"| {row} | {m['idle_p90_ms']:.0f} | {m['quiet_p90_ms']:.0f} ({m['quiet_x_idle']:.2f}) "
            f"| {m['high_p90_ms']:.0f} ({m['high_x_idle']:.2f}) "
            f"| {m['flood_done']:.0f} ({m.get('flood_x_off', 1.0):.2f}) | {m['held']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per row, alternating rows (medians)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="the engines' step budget (default: the sim's 8192)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_flow_isolation.json")
    args = parser.parse_args(argv)
    sim = dict(SIM)
    if args.max_num_batched_tokens:
        sim["max_num_batched_tokens"] = args.max_num_batched_tokens
    started = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    with tempfile.TemporaryDirectory() as logs, run_replicas(2, log_dir=Path(logs), **sim) as fleet:
        for k in range(args.repeat):
            for row, settings in ROWS.items():
                cell = measure_row(fleet, settings)
                runs[row].append(cell)
                print(f"run {k + 1}/{args.repeat} {row}: {json.dumps({key: round(v, 1) for key, v in cell.items()})}")
    summary = summarize(runs)
    print()
    print(table(summary))
    result = {
        "meta": {
            "repeat": args.repeat,
            "sim": sim,
            "flood_rate": FLOOD_RATE,
            "window_s": WINDOW_S,
            "rows": ROWS,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "elapsed_s": round(time.monotonic() - started, 1),
            "loadavg_end": [round(x, 1) for x in os.getloadavg()],
        },
        "runs": runs,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
