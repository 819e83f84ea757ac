"""What one request body costs in memory on the way through the gateway, per body byte.

    python benchmarks/bench_body_memory.py          # ~1 min; writes benchmarks/results/bench_body_memory.json

``server.max_buffered_body_bytes`` counts raw body bytes; what a process really holds for
them is more: the chunks and their join, the parsed JSON, a rewritten copy when
normalization moves values, the bytes sent upstream.  This runs the request path's own
stages in-process on the demo config's ``Gateway`` (built, not started: no network), for
bodies of ``server.max_body_bytes`` (10 MiB) of several shapes, and reports with
tracemalloc, per raw body byte:

- **peak**: the most the request had allocated at any moment (read, join, parse, plan,
  the upstream bytes), what a burst of simultaneous arrivals costs;
- **held**: what stays allocated while the request is in flight afterwards (its raw body,
  parsed body, plan (with a relocated body's rewritten copy) and upstream payload, which the
  handler keeps until it finishes);
- **retained**: what the gateway's own bounded state (indexes, learners) grew by, which
  outlives the request.

The dated system prompt takes the relocation path: the demo route moves a value once it has
seen it change, so the gateway is first shown the template with other values (``teach``).

And, with ``--in-flight N`` (on by default, 500), what a request costs a gateway process
while it waits for its replica, whatever its body: N small chat requests held at once by a
simulated replica that answers after 8 s, the gateway's RSS before and with all N in flight
(``prefix_gateway_in_flight``).  The two turn both caps into memory in ``docs/sizing.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import re
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks.processes import serve_gateway  # noqa: E402
from benchmarks.procstat import rss_bytes  # noqa: E402
from gateway.config import load_config, packaged_default_config  # noqa: E402
from gateway.proxy.handler import upstream_body  # noqa: E402
from gateway.proxy.parse import as_utf8, parse_body, read_body  # noqa: E402
from gateway.service import Gateway  # noqa: E402
from gateway.sim.launcher import run_replicas  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_body_memory.json"
MODEL = "demo-model"
CHUNK = 65536  # what uvicorn hands the app at a time under flow control (its high-water mark)


DATED = "chat, dated system prompt (relocated: a rewritten copy)"


def dated_system(day: str = "2026-12-01", clock: str = "20:37:02", request_id: str = "4f1c9a7e") -> str:
    return f"You are a helpful assistant. Today is {day} and the time is {clock}. Request id {request_id}."


def teach(gateway: Gateway) -> None:
    """The demo route moves a value once it has seen it change at its place (a template's first
    request keeps it): show it the dated system prompt once with other values, as every later
    request of the template finds it, so that the dated body takes the relocation path."""
    system = dated_system("2026-11-30", "19:12:44", "9b0d3e21")
    body = {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    gateway.plan("chat", body, {}, "bench-teach")


def bodies(size: int) -> dict[str, tuple[str, bytes]]:
    """name → (endpoint, bytes of about ``size``)."""
    words = "the quick brown fox jumps over the lazy dog "
    system = dated_system()
    text = words * (size // len(words))
    cjk = "漢字かな交じり文の長い文書。" * (size // 42)
    per_message = 60
    return {
        "chat, one long ASCII message": (
            "chat",
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text[: size - 200]}]}).encode(),
        ),
        "chat, CJK text (UTF-8, not escaped)": (
            "chat",
            json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": cjk[: (size - 200) // 3]}]},
                ensure_ascii=False,
            ).encode(),
        ),
        DATED: (
            "chat",
            json.dumps(
                {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": text[: size - 400]},
                    ],
                    "stream": True,
                }
            ).encode(),
        ),
        "chat, many short messages": (
            "chat",
            json.dumps(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hello there"}] * (size // per_message),
                }
            ).encode(),
        ),
        "completions, token ids": (
            "completions",
            json.dumps({"model": MODEL, "prompt": [10_000 + i % 89_999 for i in range(size // 7 - 10)]}).encode(),
        ),
    }


async def _receive_from(raw: bytes) -> Any:
    chunks = [raw[i : i + CHUNK] for i in range(0, len(raw), CHUNK)]
    del raw

    async def receive() -> dict[str, Any]:
        body = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": body, "more_body": bool(chunks)}

    return receive


def measure(gateway: Gateway, endpoint: str, raw: bytes) -> dict[str, Any]:
    """``raw`` was allocated before tracing starts; its chunks (what the server receives) are traced.

    held: what the request's own objects hold (freed when they are released); retained: what
    stays allocated after that (the gateway's bounded indexes and learners, grown by it).  The
    objects go into a list, not out as the coroutine's result: ``asyncio.run`` formats its
    task's repr (the result's included) on the way out, which would count in the peak.
    """
    size = len(raw)
    limit = gateway.config.server.max_body_bytes
    stream_usage = gateway.config.upstream.stream_usage
    kept: list[Any] = []

    async def path() -> None:
        receive = await _receive_from(raw)
        got = await read_body(receive, limit, str(size))
        got = as_utf8(got)
        body = parse_body(got, endpoint)
        plan = gateway.plan(endpoint, body, {}, "bench")
        payload, _ = upstream_body(got, body, plan, stream_usage)
        kept.extend((got, body, plan, payload))  # what the handler keeps until the request ends

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    asyncio.run(path())
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    rewritten, relocated = kept[3] is not kept[0], kept[2].body is not None
    kept.clear()
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    held = current - base - retained
    return {
        "body_bytes": size,
        "peak_bytes": peak - base,
        "held_bytes": held,
        "retained_bytes": retained,
        "peak_per_body_byte": round((peak - base) / size, 2),
        "held_per_body_byte": round(held / size, 2),
        "retained_per_body_byte": round(retained / size, 2),
        "rewritten": rewritten,
        "relocated": relocated,
    }


def _in_flight(text: str) -> int:
    match = re.search(r"^prefix_gateway_in_flight (\S+)$", text, re.M)
    return int(float(match.group(1))) if match else 0


async def _hold(url: str, n: int, pid: int, latency_s: float) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(base_url=url, timeout=latency_s + 60, limits=limits) as client:
        await client.post("/v1/chat/completions", json=body)  # connections to the replica opened once
        before = rss_bytes(pid)
        tasks = [asyncio.create_task(client.post("/v1/chat/completions", json=body)) for _ in range(n)]
        deadline = time.monotonic() + latency_s
        held = 0
        while time.monotonic() < deadline:
            held = _in_flight((await client.get("/metrics")).text)
            if held >= n:
                break
            await asyncio.sleep(0.1)
        during = rss_bytes(pid)
        statuses = [r.status_code for r in await asyncio.gather(*tasks)]
    return {
        "requests": n,
        "in_flight_seen": held,
        "rss_before_mib": round(before / 2**20, 1),
        "rss_in_flight_mib": round(during / 2**20, 1),
        "bytes_per_request_in_flight": round((during - before) / n),
        "answered_200": statuses.count(200),
    }


def in_flight_overhead(n: int, latency_s: float = 8.0) -> dict[str, Any]:
    """Gateway RSS per request in flight: ``n`` small requests held by a replica that answers late."""
    sim = {"time_scale": 0, "disable_uvicorn_access_log": True, "disable_log_stats": True}
    with (
        tempfile.TemporaryDirectory(prefix="bench-body-") as tmp,
        run_replicas(1, log_dir=Path(tmp), extra_latency_ms=latency_s * 1000, **sim) as urls,
    ):
        config = {
            "server": {"host": "127.0.0.1", "port": 0, "max_concurrency": n + 100},
            "logging": {"summary_interval_s": 0, "access_log": False},
            "replicas": [{"name": "r0", "url": urls[0]}],
            "routes": [{"name": "main", "policy": "prefix"}],
        }
        with serve_gateway(config, Path(tmp) / "gateway.log") as (url, proc):
            return asyncio.run(_hold(url, n, proc.pid, latency_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=10.0, help="body size (default: max_body_bytes, 10 MiB)")
    parser.add_argument("--in-flight", type=int, default=500, help="requests held at once (0: skip)")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    gateway = Gateway(load_config(packaged_default_config()))
    gateway._warm_pipelines()
    teach(gateway)
    size = int(args.mib * 2**20)
    rows = {}
    for name, (endpoint, raw) in bodies(size).items():
        rows[name] = measure(gateway, endpoint, raw)
    print(f"{'body':<58} {'MiB':>6} {'peak x':>7} {'held x':>7} {'retained x':>10}  rewritten  relocated")
    for name, row in rows.items():
        mib, peak, held = row["body_bytes"] / 2**20, row["peak_per_body_byte"], row["held_per_body_byte"]
        retained = row["retained_per_body_byte"]
        print(f"{name:<58} {mib:>6.1f} {peak:>7} {held:>7} {retained:>10}  {row['rewritten']!s:<9}  {row['relocated']}")
    held = in_flight_overhead(args.in_flight) if args.in_flight else None
    if held is not None:
        print(
            f"{held['in_flight_seen']} requests in flight: gateway RSS {held['rss_before_mib']} -> "
            f"{held['rss_in_flight_mib']} MiB, {held['bytes_per_request_in_flight'] / 1024:.1f} KiB per request "
            f"({held['answered_200']}/{held['requests']} answered 200)"
        )
    if not args.no_save:
        result = {"bodies": rows, "in_flight": held, "machine": {"python": platform.python_version()}}
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
