"""bench_sim measures what its table says: each row loads the replica it names (access log on
for "default", off for "quiet"), reads "sim CPU" from that replica's process, and counts as
"requests" exactly what that replica served in the timed window; a short run writes its table and
its JSON with the fields the docstring names.

The replicas are the benchmark's own (``ReplicaGroup``, wrapped to remember what it started and
to read each replica's log before it stops); ``cpu_seconds`` is wrapped to note which process it
read and, at that moment, the replica's own count of finished requests (``/metrics``): its two
calls bracket the timed window exactly, after the warm-up and after the last timed request.
The load loop's error count is checked apart, against a tiny server that answers 200, 503 or
cuts the connection in turn: served and errors are counted apart, and a cut connection is an
error, not the end of the run.  docs/simulator.md's figures are checked to be of this counting
(dated no earlier than its change, saying what is counted) and its quoted commands to run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import bench_sim as bs

pytestmark = pytest.mark.slow  # simulator processes and a few seconds of load


class RecordingGroup(bs.ReplicaGroup):
    """The benchmark's ReplicaGroup, remembered, with each replica's log read before it stops."""

    started: list[RecordingGroup] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logs: list[str] = []
        RecordingGroup.started.append(self)

    def stop(self, timeout: float = 5.0) -> None:
        if self.log_dir is not None and self.replicas and not self.logs:
            self.logs = [p.read_text() for p in sorted(self.log_dir.glob("replica-*.log"))]
        super().stop(timeout)

    @property
    def quiet(self) -> bool:
        return self.options[0].disable_uvicorn_access_log


def served(url: str) -> float:
    """The replica's own count of finished requests (``vllm:request_success_total``, every reason)."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        total += sum(s.value for s in family.samples if s.name == "vllm:request_success_total")
    return total


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> tuple[list[RecordingGroup], list[tuple[int, float, float]]]:
    """The groups the benchmark starts and each ``cpu_seconds`` call: (pid, CPU s, replica's served count)."""
    groups: list[RecordingGroup] = []
    calls: list[tuple[int, float, float]] = []
    real_cpu = bs.cpu_seconds
    monkeypatch.setattr(RecordingGroup, "started", groups)
    monkeypatch.setattr(bs, "ReplicaGroup", RecordingGroup)

    def cpu_seconds(pid: int) -> float:
        group = next((g for g in groups if g.replicas[0].process.pid == pid), None)
        assert group is not None, f"sim CPU read from pid {pid}, which is none of the benchmark's replicas"
        cpu = real_cpu(pid)
        calls.append((pid, cpu, served(group.urls[0])))
        return cpu

    monkeypatch.setattr(bs, "cpu_seconds", cpu_seconds)
    return groups, calls


def access_lines(log: str, path: str) -> int:
    return log.count(f'"POST {path} HTTP/1.1" 200')


def test_each_row_loads_its_own_replica_and_counts_every_request_it_served(recorded) -> None:
    groups, calls = recorded
    results = bs.run(0.3, [2], quick=True)
    assert [r.scenario for r in results] == [s.name for s in bs.SCENARIOS[:2]]
    assert [(r.replica, r.concurrency, r.headline) for r in results] == [("default", 2, True), ("quiet", 2, False)]
    assert len(groups) == 2 and sorted(g.quiet for g in groups) == [False, True]
    by_kind = {"quiet" if g.quiet else "default": g for g in groups}
    assert len(calls) == 2 * len(results), "two CPU readings per row: after the warm-up and at the end"
    for result, (start, end) in zip(results, zip(calls[::2], calls[1::2], strict=True), strict=True):
        pid = by_kind[result.replica].replicas[0].process.pid
        assert start[0] == end[0] == pid, f"{result.scenario}: sim CPU read from another process"
        assert result.errors == 0 and result.requests > 0
        # every request the replica finished in the timed window is counted, and nothing else
        assert end[2] - start[2] == result.requests, f"{result.scenario}: replica served {end[2] - start[2]}"
        cpu_s = end[1] - start[1]
        assert result.rps_per_sim_core == (round(result.requests / cpu_s, 0) if cpu_s > 0 else 0.0)
    # the headline replica logs every request (warm-up too); the "no access log" one none
    default, quiet = by_kind["default"].logs[0], by_kind["quiet"].logs[0]
    assert access_lines(default, "/v1/chat/completions") >= results[0].requests
    assert "POST /v1/chat/completions" not in quiet and quiet.strip(), "quiet replica: no access log lines"


def test_served_and_errors_are_counted_apart_and_a_cut_connection_is_an_error(monkeypatch) -> None:
    """200s are served and timed; 503s and cut connections are errors, neither served nor timed."""
    answered = {"200": 0, "503": 0, "cut": 0}
    windows: list[dict[str, int]] = []

    def cpu_seconds(pid: int) -> float:  # called right after the warm-up and after the timed run
        windows.append(dict(answered))
        return 0.0

    monkeypatch.setattr(bs, "cpu_seconds", cpu_seconds)

    async def one_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after the other
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
                await reader.readexactly(int(length.group(1)) if length else 0)
                turn = sum(answered.values()) % 4
                if turn == 3:  # the request read, no answer: the client sees the connection cut
                    answered["cut"] += 1
                    return
                status = "503" if turn == 1 else "200"
                answered[status] += 1
                writer.write(
                    f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}".encode()
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def scenario() -> tuple[int, int, float, list[float], float]:
        server = await asyncio.start_server(one_connection, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await bs._load(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}", 2, 0.3, os.getpid())
        finally:
            server.close()

    served, errors, _, latencies, _ = asyncio.run(scenario())
    start, end = windows  # after the warm-up and at the end: the timed window
    assert served == end["200"] - start["200"] > 0 and len(latencies) == served
    assert errors == end["503"] - start["503"] + end["cut"] - start["cut"]
    assert end["cut"] > start["cut"] and end["503"] > start["503"]


def test_a_short_run_writes_its_table_and_json(recorded, tmp_path: Path, capsys, monkeypatch) -> None:
    groups, calls = recorded
    out = tmp_path / "sim.json"
    monkeypatch.setattr(bs, "RESULTS", tmp_path / "never.json")  # --out wins over the default path
    code = bs.main(["--duration", "0.25", "--concurrency", "1", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert not (tmp_path / "never.json").exists()
    assert {"benchmark", "target_rps", "passed", "headline_worst_rps", "duration_s", "machine", "when", "results"} <= (
        set(result)
    )
    assert result["benchmark"] == "bench_sim" and result["duration_s"] == 0.25
    rows = result["results"]
    # the headline scenario at every level, the others at the highest one
    expected = [(bs.SCENARIOS[0].name, 1), (bs.SCENARIOS[0].name, 2)] + [(s.name, 2) for s in bs.SCENARIOS[1:]]
    assert [(r["scenario"], r["concurrency"]) for r in rows] == expected
    assert set(rows[0]) == set(bs.Result.__dataclass_fields__)
    headline = [r["rps"] for r in rows if r["headline"]]
    assert result["headline_worst_rps"] == min(headline)
    assert result["passed"] == (min(headline) >= bs.TARGET_RPS and not any(r["errors"] for r in rows))
    assert code == (0 if result["passed"] else 1)
    assert all(r["errors"] == 0 and r["requests"] > 0 for r in rows)
    # streaming and long-prefix rows too: each counts what its replica finished in its window
    windows = [end[2] - start[2] for start, end in zip(calls[::2], calls[1::2], strict=True)]
    assert windows == [r["requests"] for r in rows]
    # every scenario's path reached the replica it names
    default = next(g for g in groups if not g.quiet).logs[0]
    assert access_lines(default, "/v1/completions") > 0
    text = capsys.readouterr().out
    assert "| scenario" in text and "req/s per sim core" in text
    assert all(f"| {r['scenario']:<46} | {r['concurrency']:>4} |" in text for r in rows)
    assert ("-> PASS" if result["passed"] else "-> FAIL") in text
    assert f"wrote {out}" in text


DOC = Path(__file__).resolve().parents[2] / "docs" / "simulator.md"
COUNTING_SINCE = "2026-12-06"  # since then only 200s are requests and a failed connection is an error


def doc_figures() -> str:
    """docs/simulator.md's bench_sim paragraph and its table: "## Performance" to the table's end."""
    section = DOC.read_text().split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
    head, table = section.split("\n|", 1)
    return head + "\n|" + table.split("\n\n", 1)[0]


def test_the_simulator_doc_quotes_working_commands_and_figures_counted_as_now(monkeypatch, tmp_path) -> None:
    """The commands the doc quotes run (the load stubbed out); its figures are dated no earlier
    than the counting change, name the machine's cores, and the paragraph says what is counted."""
    text = doc_figures()
    commands = re.findall(r"`python3? benchmarks/bench_sim\.py([^`]*)`", text)
    flags = re.findall(r"`(--(?:quick|duration|concurrency|out)\b[^`]*)`", text)
    assert commands and "--quick" in flags
    row = bs.Result("chat, small, non-stream", "default", 8, 100, 0, 1.0, 2000.0, 1.0, 2.0, 50.0, 4000.0, True)
    runs: list[tuple[float, list[int], bool]] = []
    monkeypatch.setattr(bs, "run", lambda *args: runs.append(args) or [row])
    for argv in [c.split() for c in commands] + [f.split() for f in flags]:
        assert bs.main([*argv, "--out", str(tmp_path / "sim.json")]) == 0, argv
    assert runs[-1] == (2.0, [8, 64], True) and runs[0] == (5.0, [8, 64], False)
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    assert dates and min(dates) >= COUNTING_SINCE, f"figures dated {dates}, before bench_sim counted 200s only"
    assert re.search(r"\b2-core\b|\b2 cores\b", text), "the machine's cores"
    assert "answered 200" in text and "`errors`" in text, "what the columns count"
