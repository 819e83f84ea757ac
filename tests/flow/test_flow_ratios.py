"""Isolation under saturation, measured as ratios in one run (real sims, the openai SDK).

A fleet of two simulated replicas with four sequences each; the gateway saturates at four in
flight per replica (the engine's ``max_num_seqs``), so while it is saturated requests wait at
the gateway, where priority and fairness can order them, instead of in the engines' FCFS
queues.  Every measurement sends prompts of its own (no run finds an earlier one's cached).

- two tenants, the flood sending 10x the quiet one's rate (and more than the fleet serves):
  the quiet tenant's TTFT p90 stays <= 2x its value on the idle fleet, and the flood's
  throughput stays >= 90 % of what it gets with flow control off;
- a high-priority band keeps its TTFT p90 <= 1.5x idle under a low-priority flood.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gw_helpers import MODEL, running_gateway, wait_for

from gateway.http.server import RunningGateway
from gateway.sim.launcher import run_replicas

pytestmark = [
    pytest.mark.slow,
    # Not met yet (docs/flow-control.md "Status"; 2-core box, each run's own prompts, warm idle
    # baseline): the flood keeps ~93 % of its throughput, but the quiet tenant's and the high
    # band's TTFT p90 are ~3.2x idle (~215 ms against ~67; without flow control the quiet p90 is
    # ~4.2 s).  The gateway keeps the engines' queues empty (saturated at max_num_seqs), so what
    # is left is the wait for a sequence slot to free (the flood's requests hold all 8 for
    # ~250 ms each) and for the engine's current step; only idling slots (the flood's
    # throughput) or engine-side preemption would remove it.  Measured 2026-12-04 (the quiet
    # flow's requests): gateway wait mean 50-72 ms (a slot frees every ~60 ms fleet-wide), then
    # the engine's step boundary (~25 ms mean) and a prefill step the flood's next request often
    # shares (~60-70 ms); the idle TTFT is that last step alone.  Not the harness: with the
    # gateway in its own process instead of a thread the ratio is the same (3.30/3.32 against
    # 3.14/3.21, two runs each).  Kept running so the numbers stay visible; strict=False.
    # raises=AssertionError: only the ratio asserts may fail; anything else (a client library
    # that changed under the harness, say) is an error, not an expected miss
    pytest.mark.xfail(
        reason="issue 26 ratio targets not met on the simulator yet", strict=False, raises=AssertionError
    ),
]

SEQS = 4
SIM = {
    "time_scale": 1.0,
    "max_num_seqs": SEQS,
    "decode_ms_per_token": 10.0,
    "prefill_tokens_per_s": 5000.0,
    "max_output_tokens": 64,
    "num_gpu_blocks": 8192,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}
SATURATION = {"in_flight": SEQS, "queued_prefill_tokens": 0, "waiting": 0, "kv_cache_usage": 0, "scrape_stale_s": 0}
FLOOD_RATE = 40.0  # req/s: over what the fleet serves at 20 tokens each
WINDOW_S = 4.0
FLOOD_TOKENS = 20
QUIET_EVERY = 10  # one quiet request per this many flood requests


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    with run_replicas(2, log_dir=tmp_path_factory.mktemp("ratio-sims"), **SIM) as urls:
        yield urls


_RUNS = itertools.count()  # each measurement's prompts are its own


def prompt(tag: str, i: int, words: int) -> list[dict[str, str]]:
    # distinct from the first word: no prefix-cache hits to blur the comparison — also none
    # from an earlier measurement on the same replicas (``tag`` carries the run's number): the
    # second of two runs over the same prompts found them cached and served ~40 % more
    return [{"role": "user", "content": f"{tag} {i} " + " ".join(f"w{i}x{k}" for k in range(words))}]


async def ttft(client: Any, messages: list[dict[str, str]], max_tokens: int, **headers: str) -> float:
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


def p90(values: list[float]) -> float:
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


def drained(fleet: list[str]) -> None:
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


def test_two_tenants_quiet_ttft_and_flood_throughput(fleet: list[str]) -> None:
    tenant = "x-llm-d-inference-fairness-id"
    with running_gateway(fleet, flow_control={"enabled": True, "saturation": SATURATION}) as gw:
        idle = asyncio.run(idle_ttfts(gw))
        quiet_on, flood_on = asyncio.run(flooded(gw, {tenant: "quiet"}, {tenant: "flood"}))
        held = gw.gateway.flow.routes["main"].totals["queued"]
    drained(fleet)
    with running_gateway(fleet, flow_control={"enabled": False}) as gw:
        quiet_off, flood_off = asyncio.run(flooded(gw, {tenant: "quiet"}, {tenant: "flood"}))
    drained(fleet)
    report = (
        f"quiet TTFT p90: idle {p90(idle) * 1000:.0f} ms, flooded with flow control {p90(quiet_on) * 1000:.0f} ms, "
        f"without {p90(quiet_off) * 1000:.0f} ms; flood done in {WINDOW_S:g} s: {flood_on} with, {flood_off} without; "
        f"{held} requests held"
    )
    print(report)
    assert held > 0, "the fleet never saturated: the test measured nothing"
    assert p90(quiet_on) <= 2.0 * p90(idle), report
    assert flood_on >= 0.9 * flood_off, report


def test_high_priority_band_under_a_low_priority_flood(fleet: list[str]) -> None:
    settings = {"enabled": True, "saturation": SATURATION, "objectives": {"interactive": 10}}
    with running_gateway(fleet, flow_control=settings) as gw:
        idle = asyncio.run(idle_ttfts(gw))
        high, _ = asyncio.run(flooded(gw, {"x-llm-d-inference-objective": "interactive"}, {}))
        held = gw.gateway.flow.routes["main"].totals["queued"]
    drained(fleet)
    report = f"high band TTFT p90: idle {p90(idle) * 1000:.0f} ms, under the flood {p90(high) * 1000:.0f} ms"
    print(report)
    assert held > 0, "the fleet never saturated"
    assert p90(high) <= 1.5 * p90(idle), report
