"""bench_proxy's gateway-vs-direct pairs really are: one short run of its ``main`` with every
request counted on both sides.

The run is the benchmark's own (its replicas, its gateway processes, its phases and load loops)
with the phases' sizes shrunk (a few hundred ms each).  Wrapped to watch, not to change: each
gateway it starts (which replica it fronts, its pid, the replica header it answers with, its
log), each closed/open loop and stream run (the URL it loaded, what it says it sent, and how much
every gateway's ``prefix_gateway_requests_total`` and every replica's
``vllm:request_success_total`` moved meanwhile), and each ``cpu_seconds`` reading.  Checked:
"direct" rows reach a replica and no gateway, "gateway" rows pass through the gateway over that
same replica, served + errors = sent in every loop, the instant pair carries the latency and
peak phases and the real-time pair the stream gaps, the gateway CPU columns are read from the
gateway process, and the table and JSON carry the fields the docstring names, written to
``--out`` (a folder outside the repository here).  The error counts are checked apart, against a
tiny server that fails the requests it is told to: an error answer is no stream's first chunk,
and the open and closed loops' warm-up errors are not the timed run's (a failed warm-up request
does not end the closed loop's warm-up); and against a raw server that closes connections before
the answer or mid-stream, and a port that refuses them: each is a stream error, none is timed,
and the run goes on.  A closed loop against a replica that fails or refuses every request backs
off (no hot loop: at most what its back-off schedule allows, each error a request sent), never
past its deadline, and pauses only after errors.  Every phase's warm-up errors, the open loop's
included, reach the JSON per side and the line under the table (with fake loops, no processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import bench_proxy as bp
from tests.polling import wait_for

pytestmark = pytest.mark.slow  # two replicas, two gateway processes and a few seconds of load

RATE = 40.0  # --rate: the open loop sends RATE * OPEN_S requests per side and round
OPEN_S, ROUNDS, PEAK_S, STREAMS, STREAM_C, TOKENS = 0.25, 2, 0.3, 4, 2, 4


def counter(url: str, name: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        total += sum(s.value for s in family.samples if s.name == name)
    return total


class Watch:
    """What the run started and what each of its loops did."""

    def __init__(self) -> None:
        self.replicas: dict[str, dict[str, Any]] = {}  # url -> the options it was started with
        self.gateways: dict[str, dict[str, Any]] = {}  # gateway url -> replica, pid, header, log
        self.loops: list[dict[str, Any]] = []
        self.phases: list[tuple[str, tuple[Any, ...]]] = []  # (phase, the arguments main passed)
        self.cpu_reads: list[tuple[int, float]] = []

    def counts(self) -> dict[str, float]:
        gw = {url: counter(url, "prefix_gateway_requests_total") for url in self.gateways}
        return gw | {url: counter(url, "vllm:request_success_total") for url in self.replicas}

    def loop(self, real: Any, sent: Any) -> Any:
        """An async load function, watched: ``sent(args, result)`` is what it says it sent."""

        async def watched(url: str, *args: Any) -> dict[str, Any]:
            base = url.removesuffix("/v1/chat/completions")
            before = self.counts()
            result = await real(url, *args)
            n = sent(args, result)
            wait_for(lambda: max(self.counts()[base] - before[base], 0) >= n, 10, what=f"{n} requests at {base}")
            after = self.counts()
            moved = {u: after[u] - before[u] for u in after}
            self.loops.append({"fn": real.__name__, "base": base, "args": args, "result": result, "sent": n, **moved})
            return result

        return watched


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Watch, dict[str, Any], str]]:
    tmp = tmp_path_factory.mktemp("proxy")
    watch = Watch()
    real = {name: getattr(bp, name) for name in ("run_replicas", "gateway_process", "cpu_seconds")}
    phases = {"added": bp.phase_added_latency, "peak": bp.phase_peak, "gaps": bp.phase_stream_gaps}

    @contextlib.contextmanager
    def run_replicas(n: int, **options: Any) -> Iterator[list[str]]:
        with real["run_replicas"](n, **options) as urls:
            watch.replicas.update({u: options for u in urls})
            yield urls

    @contextlib.contextmanager
    def gateway_process(replica_url: str, log_path: Path) -> Iterator[tuple[str, int]]:
        with real["gateway_process"](replica_url, log_path) as (url, pid):
            probe = httpx.post(f"{url}/v1/chat/completions", json=bp.SMALL_CHAT, timeout=10)
            direct = httpx.post(f"{replica_url}/v1/chat/completions", json=bp.SMALL_CHAT, timeout=10)
            watch.gateways[url] = {
                "replica": replica_url,
                "pid": pid,
                "header": probe.headers.get("x-prefix-gateway-replica"),
                "direct_header": direct.headers.get("x-prefix-gateway-replica"),
            }
            yield url, pid
            watch.gateways[url]["log"] = log_path.read_text()

    def cpu_seconds(pid: int) -> float:
        value = real["cpu_seconds"](pid)
        watch.cpu_reads.append((pid, value))
        return value

    def shrunk(name: str, sizes: Any) -> Any:
        def phase(*args: Any) -> Any:
            watch.phases.append((name, args))
            return phases[name](*sizes(args))

        return phase

    with pytest.MonkeyPatch.context() as mp:
        # --out wins over the default folder (never written here); tmp is outside the repository
        mp.setattr(bp, "RESULTS", tmp / "never")
        mp.setattr(bp, "run_replicas", run_replicas)
        mp.setattr(bp, "gateway_process", gateway_process)
        mp.setattr(bp, "cpu_seconds", cpu_seconds)
        mp.setattr(bp, "phase_added_latency", shrunk("added", lambda a: (*a[:3], OPEN_S, ROUNDS)))
        mp.setattr(bp, "phase_peak", shrunk("peak", lambda a: (*a[:4], PEAK_S, a[5])))
        mp.setattr(bp, "phase_stream_gaps", shrunk("gaps", lambda a: (a[0], a[1], STREAMS, STREAM_C, TOKENS)))
        # every request of a loop: warm-up + timed + errors (the open loop warms up with 20)
        mp.setattr(bp, "open_loop", watch.loop(bp.open_loop, lambda a, r: 20 + len(r["latencies"]) + r["errors"]))
        mp.setattr(
            bp,
            "closed_loop",
            watch.loop(
                bp.closed_loop,
                lambda a, r: r["warmup_requests"] + r["warmup_errors"] + len(r["latencies"]) + r["errors"],
            ),
        )
        mp.setattr(bp, "stream_gaps", watch.loop(bp.stream_gaps, lambda a, r: a[1]))  # (body, streams, conc)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = bp.main(["--quick", "--concurrency", "2", "--rate", str(RATE), "--out", str(tmp / "out")])
    assert code == 0 and not (tmp / "never").exists()
    assert f"wrote {tmp / 'out' / 'bench_proxy.json'}" in out.getvalue()
    yield watch, json.loads((tmp / "out" / "bench_proxy.json").read_text()), out.getvalue()


def gateway_over(watch: Watch, replica: str) -> str:
    urls = [u for u, g in watch.gateways.items() if g["replica"] == replica]
    assert len(urls) == 1, f"gateways over {replica}: {urls}"
    return urls[0]


def test_direct_loops_reach_only_the_replica_and_gateway_loops_pass_through_its_gateway(run) -> None:
    watch, _, _ = run
    assert len(watch.replicas) == 2 and len(watch.gateways) == 2
    for url, gateway in watch.gateways.items():
        assert gateway["replica"] in watch.replicas, f"{url} fronts no replica of the run"
        assert gateway["header"] == "r0" and gateway["direct_header"] is None
    assert {loop["fn"] for loop in watch.loops} == {"open_loop", "closed_loop", "stream_gaps"}
    for loop in watch.loops:
        base, n = loop["base"], loop["sent"]
        if base in watch.gateways:
            behind = watch.gateways[base]["replica"]
            assert loop[base] == n and loop[behind] == n, f"{loop['fn']} via {base}: {loop}"
            others = [u for u in watch.gateways if u != base] + [u for u in watch.replicas if u != behind]
        else:
            assert base in watch.replicas, f"{loop['fn']} loaded {base}, neither a replica nor a gateway"
            assert loop[base] == n, f"{loop['fn']} direct to {base}: {loop}"
            others = list(watch.gateways) + [u for u in watch.replicas if u != base]
        assert all(loop[u] == 0 for u in others), f"{loop['fn']} at {base} also reached {others}: {loop}"


def pairs(watch: Watch) -> tuple[str, str, str, str]:
    """(instant replica, its gateway, real-time replica, its gateway)."""
    instant = next(u for u, o in watch.replicas.items() if o["time_scale"] == 0)
    realtime = next(u for u, o in watch.replicas.items() if o["time_scale"] == 1.0)
    return instant, gateway_over(watch, instant), realtime, gateway_over(watch, realtime)


def loops(watch: Watch, fn: str) -> list[dict[str, Any]]:
    return [loop for loop in watch.loops if loop["fn"] == fn]


def test_each_phase_gets_the_pair_its_docstring_names(run) -> None:
    watch, _, _ = run
    instant, gw_instant, realtime, gw_realtime = pairs(watch)
    assert watch.replicas[realtime]["decode_ms_per_token"] == 20
    assert [p[0] for p in watch.phases] == ["added", "peak", "peak", "gaps"]
    for name, args in watch.phases:
        expected = (realtime, gw_realtime) if name == "gaps" else (instant, gw_instant)
        assert args[:2] == expected, f"{name}: direct/gateway were {args[:2]}"
        if name == "peak":
            assert args[2] == watch.gateways[gw_instant]["pid"]
    # and each phase loads direct first, then through the gateway
    assert [o["base"] for o in loops(watch, "open_loop")] == [instant, gw_instant] * ROUNDS
    assert [c["base"] for c in loops(watch, "closed_loop")] == [instant, gw_instant] * 2
    assert [g["base"] for g in loops(watch, "stream_gaps")] == [realtime] * 2 + [gw_realtime] * 2  # warm-up, timed
    # the gateway runs its default config: one access-log line per request (the wrapper's probe too)
    logged = watch.gateways[gw_instant]["log"].count("prefix_gateway.access: 127.0.0.1")
    assert logged == 1 + sum(loop["sent"] for loop in watch.loops if loop["base"] == gw_instant)


def test_every_loop_counts_every_request_and_each_column_reads_its_own_side(run) -> None:
    watch, result, _ = run
    instant, _, _, _ = pairs(watch)
    opens = loops(watch, "open_loop")
    assert all(len(o["result"]["latencies"]) + o["result"]["errors"] == int(RATE * OPEN_S) for o in opens)
    added = result["added_latency"]
    assert added["requests_each"] == ROUNDS * int(RATE * OPEN_S) and added["errors"] == 0
    assert added["rounds"] == ROUNDS and len(added["per_round"]) == ROUNDS
    for side in ("direct", "gateway"):
        pooled = [x for o in opens if (o["base"] == instant) == (side == "direct") for x in o["result"]["latencies"]]
        assert added[f"{side}_p50_ms"] == bp.ms(bp.pct(pooled, 0.5)), side
        assert added[f"{side}_p99_ms"] == bp.ms(bp.pct(pooled, 0.99)), side
    gaps = loops(watch, "stream_gaps")
    assert [g["args"][1:] for g in gaps] == [(STREAM_C, STREAM_C), (STREAMS, STREAM_C)] * 2  # warm-up, timed
    for side, loop in zip(("direct", "gateway"), gaps[1::2], strict=True):
        got, row = loop["result"], result["stream_gaps"]
        assert len(got["ttfts"]) == STREAMS, f"{side}: one first chunk per stream"
        assert got["gaps"], f"{side}: the streams arrived in one piece each (not streamed?)"
        assert row[f"{side}_chunks"] == len(got["gaps"]) + len(got["ttfts"])
        assert row[f"{side}_gap_p99_ms"] == bp.ms(bp.pct(got["gaps"], 0.99))
        assert row[f"{side}_ttft_p50_ms"] == bp.ms(bp.pct(got["ttfts"], 0.5))
        assert got["errors"] == 0 == row[f"{side}_errors"]


def test_the_gateway_cpu_columns_are_read_from_the_gateway_process(run) -> None:
    watch, result, _ = run
    _, gw_instant, _, _ = pairs(watch)
    assert watch.cpu_reads and {p for p, _ in watch.cpu_reads} == {watch.gateways[gw_instant]["pid"]}
    closed, peaks = loops(watch, "closed_loop"), result["peak"]
    assert [(p["stream"], p["concurrency"]) for p in peaks] == [(False, 2), (True, 2)]
    # per peak row: a reading before each side and one after the gateway side, whose pair makes the column
    assert len(watch.cpu_reads) == 3 * len(peaks)
    for i, peak in enumerate(peaks):
        direct, through = closed[2 * i]["result"], closed[2 * i + 1]["result"]
        assert direct["errors"] == 0 == through["errors"]
        assert peak["direct_errors"] == 0 == peak["gateway_errors"]
        cpu = watch.cpu_reads[3 * i + 2][1] - watch.cpu_reads[3 * i + 1][1]
        served = len(through["latencies"]) + through["warmup_requests"]
        assert peak["gateway_cpu_us_per_req"] == round(cpu / served * 1e6, 1)
        assert peak["direct_rps"] == round(direct["rps"], 1)
        assert peak["gateway_rps"] == round(through["rps"], 1)


def test_a_short_run_writes_its_table_and_json(run) -> None:
    _, result, text = run
    assert {"machine", "targets", "added_latency", "peak", "stream_gaps"} <= set(result)
    assert {"load_before", "load_after", "cpus"} <= set(result["machine"])
    assert result["targets"] == bp.TARGETS
    for row in [result["added_latency"], *result["peak"], result["stream_gaps"]]:
        assert row["direct_warmup_errors"] == 0 == row["gateway_warmup_errors"], row
    assert "\nwarm-up errors (not in the timed figures): none\n" in text
    assert {"added_p50_ms", "added_p99_ms", "pooled_added_p50_ms", "direct_p99_ms", "gateway_p99_ms"} <= set(
        result["added_latency"]
    )
    assert {"gap_delta_p50_ms", "gap_delta_p99_ms", "ttft_delta_p50_ms"} <= set(result["stream_gaps"])
    assert text.count("\n| ") == 1 + 2 + 2 * len(result["peak"]) + 3  # header, latency, peak and stream rows
    assert "non-stream peak req/s (c=2)" in text and "stream inter-chunk gap p99 (ms)" in text
    assert "\nwrote /" in text, "a path outside the repository is printed as it is"


@contextlib.asynccontextmanager
async def failing(fail: Callable[[int], bool]) -> AsyncIterator[tuple[str, list[int]]]:
    """A chat endpoint answering its n-th request (from 0) with a 503 where ``fail(n)``, else a
    200 (a three-chunk stream when asked for one); yields its URL and the numbers it failed."""
    failed: list[int] = []
    count = 0

    async def chat(request: web.Request) -> web.StreamResponse:
        nonlocal count
        n, count = count, count + 1
        body = await request.json()
        if fail(n):
            failed.append(n)
            return web.json_response({"error": {"message": "overloaded", "code": 503}}, status=503)
        if not body.get("stream"):
            return web.json_response({"choices": [{"message": {"content": "hi"}}]})
        response = web.StreamResponse()
        await response.prepare(request)
        for chunk in (b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"):
            await response.write(chunk)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}/v1/chat/completions", failed
    finally:
        await runner.cleanup()


def test_errors_are_counted_apart_from_what_is_timed() -> None:
    async def scenario() -> tuple[dict[str, Any], list[int], dict[str, Any], list[int]]:
        streams = json.dumps({**bp.SMALL_CHAT, "stream": True}).encode()
        async with failing(lambda n: n % 3 == 0) as (url, failed_streams):  # 2 of 6 streams
            gaps = await bp.stream_gaps(url, streams, 6, 2)
        # the 20 warm-up requests all fail, then 3 of the 10 timed ones
        async with failing(lambda n: n < 23) as (url, failed_open):
            opened = await bp.open_loop(url, json.dumps(bp.SMALL_CHAT).encode(), RATE, OPEN_S)
        return gaps, failed_streams, opened, failed_open

    gaps, failed_streams, opened, failed_open = bp.run_async(scenario())
    assert failed_streams == [0, 3] and gaps["errors"] == 2
    assert len(gaps["ttfts"]) == 4, "an error answer was timed as a stream's first chunk"
    assert len(failed_open) == 23 and int(RATE * OPEN_S) == 10
    assert opened["errors"] == 3 and len(opened["latencies"]) == 7, "errors of the timed run only"
    assert opened["warmup_errors"] == 20


def test_a_failed_warm_up_request_neither_ends_the_warm_up_nor_counts_as_timed() -> None:
    """The closed loop's first three requests fail (one connection, so all in its warm-up)."""
    seen: list[int] = []

    def fail(n: int) -> bool:
        seen.append(n)
        return n < 3

    async def scenario() -> tuple[dict[str, Any], list[int]]:
        async with failing(fail) as (url, failed):
            # warm-up min(1.0, 1.0 / 4) = 0.25 s, then 1 s timed
            return await bp.closed_loop(url, json.dumps(bp.SMALL_CHAT).encode(), 1, 1.0, False), failed

    result, failed = bp.run_async(scenario())
    assert failed == [0, 1, 2]
    assert result["warmup_errors"] == 3 and result["errors"] == 0, "warm-up errors are apart from the timed ones"
    assert result["warmup_requests"] >= 1, "the warm-up stopped at its errors"
    assert len(result["latencies"]) > 0
    assert result["warmup_requests"] + result["warmup_errors"] + len(result["latencies"]) == len(seen)


def test_backoff_doubles_from_a_millisecond_to_its_cap() -> None:
    assert [bp.backoff_s(n) for n in (1, 2, 3, 7)] == [0.001, 0.002, 0.004, 0.064]
    assert bp.backoff_s(8) == bp.backoff_s(100) == bp.BACKOFF_CAP_S == 0.1


def most_errors(window: float) -> int:
    """The most errors one closed-loop connection can count in ``window`` seconds when every
    request fails at once: one per pause of its back-off schedule that starts inside the window,
    and 1 more: the event loop's timers may fire a little early (libuv reads its clock once a
    turn), so the pauses can add up to a little less than the schedule."""
    n, spent = 0, 0.0
    while spent < window:
        n += 1
        spent += bp.backoff_s(n)
    return n + 1


def test_a_closed_loop_against_a_replica_that_fails_everything_backs_off_and_counts_each_error() -> None:
    """A 503 at once for every request, and a port that refuses every connect: retried at once, each
    connection made thousands of errors a second; backing off, at most ``most_errors`` of them."""
    body, concurrency, duration = json.dumps(bp.SMALL_CHAT).encode(), 2, 1.0

    async def scenario() -> tuple[dict[str, Any], list[int], dict[str, Any]]:
        async with failing(lambda n: True) as (url, failed):
            with socket.socket() as closed:  # bound, never listening: every connect is refused
                closed.bind(("127.0.0.1", 0))
                refusing = f"http://127.0.0.1:{closed.getsockname()[1]}/v1/chat/completions"
                answered, refused = await asyncio.gather(
                    bp.closed_loop(url, body, concurrency, duration, False),
                    bp.closed_loop(refusing, body, concurrency, duration, False),
                )
        return answered, failed, refused

    answered, failed, refused = bp.run_async(scenario())
    warm_s = min(1.0, duration / 4)
    for result in (answered, refused):
        assert result["latencies"] == [] and result["rps"] == 0 and result["warmup_requests"] == 0
        assert concurrency < result["warmup_errors"] <= concurrency * most_errors(warm_s), result["warmup_errors"]
        # more than one error per connection: each went on trying to its deadline
        assert 3 * concurrency < result["errors"] <= concurrency * most_errors(duration), result["errors"]
    assert len(failed) == answered["warmup_errors"] + answered["errors"], "each error counted is a request sent"


def test_a_closed_loops_back_off_never_runs_past_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 5 s back-off, cut at the warm-up's end and then at the timed part's: one error each."""
    monkeypatch.setattr(bp, "BACKOFF_FIRST_S", 5.0)
    monkeypatch.setattr(bp, "BACKOFF_CAP_S", 5.0)

    async def scenario() -> dict[str, Any]:
        async with failing(lambda n: True) as (url, _):
            return await bp.closed_loop(url, json.dumps(bp.SMALL_CHAT).encode(), 2, 0.4, False)

    result = bp.run_async(scenario())
    assert result["warmup_errors"] == 2 and result["errors"] == 2
    assert result["seconds"] < 2.0, "a pause ran past the timed part's deadline"


def test_a_closed_loop_pauses_only_after_errors_and_a_success_resets_its_back_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Requests 0, 1 and 3 fail (one connection): pauses after 1, 2, then 1 error in a row; an
    error-free loop never pauses, so its latencies and req/s are what they were before the back-off."""
    asked: list[int] = []
    real = bp.backoff_s

    def recorded(failures: int) -> float:
        asked.append(failures)
        return real(failures)

    monkeypatch.setattr(bp, "backoff_s", recorded)
    body = json.dumps(bp.SMALL_CHAT).encode()

    async def scenario(fail: Callable[[int], bool]) -> dict[str, Any]:
        async with failing(fail) as (url, _):
            return await bp.closed_loop(url, body, 1, 0.4, False)

    some = bp.run_async(scenario(lambda n: n in (0, 1, 3)))
    assert asked == [1, 2, 1] and some["warmup_errors"] + some["errors"] == 3
    asked.clear()
    clean = bp.run_async(scenario(lambda n: False))
    assert asked == [] and clean["errors"] == clean["warmup_errors"] == 0 and clean["latencies"]


def fake_phases(monkeypatch: pytest.MonkeyPatch, warm: dict[str, int]) -> dict[str, Any]:
    """Every phase of ``main`` over fake loops (no processes): each loop's warm-up errors are
    ``warm[<phase>_<side>]`` (0 if absent), apart from its timed ones (the open loop's 2 on the
    gateway side, the timed streams' 5 a side); returns the results dict ``table`` reads."""

    def side(url: str) -> str:
        return "direct" if url.startswith("http://direct") else "gateway"

    async def open_loop(url: str, body: bytes, rate: float, duration: float) -> dict[str, Any]:
        errors = 2 if side(url) == "gateway" else 0
        return {"latencies": [0.001] * 8, "errors": errors, "warmup_errors": warm.get(f"added_{side(url)}", 0)}

    async def closed_loop(url: str, body: bytes, concurrency: int, duration: float, stream: bool) -> dict[str, Any]:
        return {
            "rps": 100.0, "latencies": [0.001] * 100, "errors": 0, "seconds": 1.0, "warmup_requests": 10,
            "warmup_errors": warm.get(f"peak_{side(url)}", 0),
        }  # fmt: skip

    async def stream_gaps(url: str, body: bytes, streams: int, concurrency: int) -> dict[str, Any]:
        warming = streams == concurrency  # the phase warms up with one stream per connection
        errors = warm.get(f"gaps_{side(url)}", 0) if warming else 5
        return {"gaps": [0.02] * 3, "ttfts": [0.01], "errors": errors}

    clock = iter(range(1000))
    monkeypatch.setattr(bp, "open_loop", open_loop)
    monkeypatch.setattr(bp, "closed_loop", closed_loop)
    monkeypatch.setattr(bp, "stream_gaps", stream_gaps)
    monkeypatch.setattr(bp, "cpu_seconds", lambda pid: float(next(clock)))
    return {
        "added_latency": bp.phase_added_latency("http://direct", "http://gw", RATE, OPEN_S, 3),
        "peak": [bp.phase_peak("http://direct", "http://gw", 1, 2, PEAK_S, stream) for stream in (False, True)],
        "stream_gaps": bp.phase_stream_gaps("http://direct", "http://gw", 4, 2, TOKENS),
    }


def test_the_open_loops_warm_up_errors_survive_the_added_latency_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    added = fake_phases(monkeypatch, {"added_direct": 1, "added_gateway": 20})["added_latency"]
    assert added["direct_warmup_errors"] == 3 * 1 and added["gateway_warmup_errors"] == 3 * 20, "summed over rounds"
    assert added["errors"] == 3 * 2, "the timed errors stay apart from the warm-up's"


def test_the_table_names_every_phase_side_whose_warm_up_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    warm = {"added_gateway": 20, "peak_gateway": 3, "gaps_direct": 1}
    results = fake_phases(monkeypatch, warm)
    gaps = results["stream_gaps"]
    assert (gaps["direct_warmup_errors"], gaps["gateway_warmup_errors"], gaps["direct_errors"]) == (1, 0, 5)
    assert bp.table(results).splitlines()[-1] == (
        "warm-up errors (not in the timed figures): added latency: direct 0, gateway 60; "
        "non-stream peak c=2: direct 0, gateway 3; stream peak c=2: direct 0, gateway 3; "
        "stream gaps: direct 1, gateway 0"
    )
    clean = bp.table(fake_phases(monkeypatch, {}))
    assert clean.splitlines()[-1] == "warm-up errors (not in the timed figures): none"
    assert sum(line.startswith("| ") for line in clean.splitlines()) == 1 + 2 + 2 * 2 + 3, "the note is no row"


@contextlib.asynccontextmanager
async def breaking(modes: Callable[[int], str]) -> AsyncIterator[tuple[str, dict[str, int]]]:
    """A raw HTTP server whose n-th connection (from 0, one request each) gets ``modes(n)``:
    "stream" (a whole three-chunk SSE stream), "cut" (the request read, the connection closed
    before any answer) or "cut_mid" (the headers and one chunk, then closed: an incomplete chunked
    body); yields its URL and how many of each it answered."""
    answered = {"stream": 0, "cut": 0, "cut_mid": 0}
    count = 0

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def one_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        n, count = count, count + 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
            await reader.readexactly(int(length.group(1)) if length else 0)
            mode = modes(n)
            answered[mode] += 1
            if mode == "cut":
                return
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n" + chunk(b'data: {"n": 1}\n\n')
            )
            await writer.drain()
            if mode == "cut_mid":
                return
            writer.write(chunk(b'data: {"n": 2}\n\n') + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(one_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1/chat/completions", answered
    finally:
        server.close()


def test_stream_gaps_counts_failed_connections_as_errors_and_times_none_of_them() -> None:
    body = json.dumps({**bp.SMALL_CHAT, "stream": True}).encode()

    async def scenario() -> tuple[dict[str, Any], dict[str, int], dict[str, Any]]:
        modes = ("stream", "cut", "cut_mid")
        async with breaking(lambda n: modes[n % 3]) as (url, answered):
            broken = await bp.stream_gaps(url, body, 9, 3)
        # a port nobody listens on (bound, never listening): every connect is refused
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            refused = await bp.stream_gaps(
                f"http://127.0.0.1:{closed.getsockname()[1]}/v1/chat/completions", body, 3, 2
            )
        return broken, dict(answered), refused

    broken, answered, refused = bp.run_async(scenario())
    assert answered == {"stream": 3, "cut": 3, "cut_mid": 3}
    assert broken["errors"] == 6, "a connection closed before the answer or mid-stream is an error"
    assert len(broken["ttfts"]) == 3, "a stream cut after its first chunk was timed"
    assert len(broken["gaps"]) <= 2 * 3
    assert refused == {"gaps": [], "ttfts": [], "errors": 3}
