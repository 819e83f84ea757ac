"""probe_faults' rows inject the fault they are named for and their columns count what they say.

Every row runs as the benchmark runs it (its ``probe_*`` function, its gateway config, its
``faultload`` traffic) against one group of four replica processes with the benchmark's own
options, at a small size (2 clients, 1-2 s).  ``run_for`` (the length of each phase of a fault)
is wrapped to look at the replicas at that moment: alive or killed, running or stopped
(``/proc/<pid>/stat``), and the faults each one is serving (``GET /sim/faults``); the frozen
row's fixed 3 s before and after the freeze are shortened to 0.5 s.  The gateway config, the
gateway and every ``metric`` read are noted too.  Checked per row: the fault is on the replica
the row names while it runs and gone after it, sent = answered + client failures (nothing in
flight or lost), the error-event and hung columns are the tally's, "gateway 5xx" is that row's
gateway's own ``requests_total{status_class="5xx"}``; and ``main`` writes its table and JSON,
with hung requests under the client failures they are part of.  The aborts row's labels are
checked on streams stopped at a known place (``abort_one`` straight to a replica made slow
to answer or stalling mid-stream), and the row counts each stream as ``abort_one`` labelled it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from benchmarks import probe_faults as pf
from benchmarks.faultload import Tally
from gateway.sim.faults import FaultSettings
from gateway.sim.launcher import ReplicaGroup

pytestmark = pytest.mark.slow  # four replica processes and a few seconds of faults per row

DEFAULT_FAULTS = FaultSettings().model_dump()


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaGroup]:
    with ReplicaGroup(4, log_dir=tmp_path_factory.mktemp("replicas"), **pf.SIM) as replicas:
        yield replicas


def state(pid: int) -> str:
    """The process state letter (R, S, T for stopped, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def faults(url: str) -> dict[str, Any]:
    """The faults a replica serves now, beyond the defaults."""
    live = httpx.get(f"{url}/sim/faults", timeout=1).json()
    return {k: v for k, v in live.items() if v != DEFAULT_FAULTS[k]}


def look(group: ReplicaGroup) -> list[dict[str, Any]]:
    """Each replica now: alive, its pid and state, and (when it can answer) its faults."""
    seen = []
    for r in group.replicas:
        pid = r.process.pid if r.process is not None else None
        now: dict[str, Any] = {"alive": r.alive, "pid": pid, "state": state(pid) if r.alive else None}
        deadline = time.monotonic() + 10
        while r.alive and now["state"] != "T" and "faults" not in now:
            try:
                now["faults"] = faults(r.url)
            except httpx.TimeoutException:
                # a SIGSTOP just sent lands a moment later: the process was running when looked at
                now["state"] = state(pid)
                assert time.monotonic() < deadline, f"replica {r.index} neither stopped nor answering"
        seen.append(now)
    return seen


@pytest.fixture
def watch(group: ReplicaGroup, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Make the group ready as ``main`` does before each row, then watch the row."""
    for r in group.replicas:
        r.signal(pf.signal.SIGCONT)
    for index in group.dead():
        group.restart(index)
    group.wait_healthy(30)
    seen: dict[str, list[Any]] = {"phases": [], "configs": [], "gateways": [], "metrics": []}
    real = {name: getattr(pf, name) for name in ("run_for", "gateway_config", "serve_in_thread", "metric")}

    def run_for(seconds: float, stop: Any = None) -> None:
        seen["phases"].append({"seconds": seconds, "replicas": look(group)})
        real["run_for"](0.5 if seconds >= 3 else seconds, stop)

    def gateway_config(urls: list[str], upstream: dict[str, Any] | None = None) -> Any:
        seen["configs"].append({"urls": list(urls), "upstream": upstream})
        return real["gateway_config"](urls, upstream)

    @contextlib.contextmanager
    def serve_in_thread(config: Any) -> Iterator[Any]:
        with real["serve_in_thread"](config) as gw:
            seen["gateways"].append(gw.url)
            yield gw

    def metric(gw: Any, name: str, **labels: str) -> float:
        value = real["metric"](gw, name, **labels)
        seen["metrics"].append((gw.url, name, labels, value))
        return value

    monkeypatch.setattr(pf, "run_for", run_for)
    monkeypatch.setattr(pf, "gateway_config", gateway_config)
    monkeypatch.setattr(pf, "serve_in_thread", serve_in_thread)
    monkeypatch.setattr(pf, "metric", metric)
    return seen


def check_columns(row: dict[str, Any], seen: dict[str, list[Any]], group: ReplicaGroup) -> None:
    """What every load row's columns must be, whatever the fault did."""
    detail = row["detail"]
    assert detail["sent"] == detail["done"] == row["sent"] > 0, f"requests in flight or lost: {detail}"
    failures = sum(detail["failed"].values()) + sum(detail["stream_failed"].values())
    failures += sum(detail["error_events"].values()) + detail["broken"] + detail["hung"]
    assert row["client_failures"] == failures == row["sent"] - detail["ok"] - detail["stream_ok"]
    assert row["error_events"] == sum(detail["error_events"].values()) and row["hung"] == detail["hung"]
    (gateway,) = seen["gateways"]
    assert [c["urls"] for c in seen["configs"]] == [group.urls], "the gateway fronts the four replicas, r0..r3"
    reads = [m for m in seen["metrics"] if m[2] == {"status_class": "5xx"}]
    assert [(url, name) for url, name, _, _ in reads] == [(gateway, "prefix_gateway_requests_total")]
    assert row["gateway_5xx"] == reads[0][3]


def check_reset(group: ReplicaGroup) -> None:
    assert all(r["alive"] and r["state"] != "T" and r["faults"] == {} for r in look(group)), "a fault outlived its row"


def test_the_kill_row_kills_r1_and_restarts_it(group, watch) -> None:
    row = pf.probe_kill(group, 2, 1.5)
    before, killed, after = (phase["replicas"] for phase in watch["phases"])
    assert [r["alive"] for r in before] == [True] * 4 and [r["alive"] for r in after] == [True] * 4
    assert [r["alive"] for r in killed] == [True, False, True, True]
    assert after[1]["pid"] != before[1]["pid"], "r1 came back as a new process"
    assert row["probe"].startswith("SIGKILL 1 of 4") and "restart after 0.6 s" in row["probe"]
    assert {"readmitted_after_restart_s", "retries"} == set(row["other"])
    check_columns(row, watch, group)
    check_reset(group)


def test_the_errors_row_makes_r0_fail_30_percent_with_503_and_r1_slow(group, watch) -> None:
    row = pf.probe_errors_and_slow(group, 2, 1.5)
    (during,) = (phase["replicas"] for phase in watch["phases"])
    assert [r["faults"] for r in during] == [{"error_rate": 0.3}, {"extra_latency_ms": 2000.0}, {}, {}]
    assert DEFAULT_FAULTS["error_status"] == 503  # r0's failures are 503s
    answered = row["other"]["non_streaming_answered_by"]
    assert set(answered) <= {"r0", "r1", "r2", "r3"} and sum(answered.values()) == row["detail"]["ok"]
    share = round(answered.get("r1", 0) / max(1, sum(answered.values())), 3)
    assert row["other"]["slow_replica_share"] == share
    check_columns(row, watch, group)
    check_reset(group)


def test_the_frozen_row_stops_every_replica_and_thaws_them(group, watch) -> None:
    row = pf.probe_frozen(group, 2, 1.0)
    before, frozen, after = (phase["replicas"] for phase in watch["phases"])
    assert [p["seconds"] for p in watch["phases"]] == [3, 1.0, 3]
    assert [r["state"] for r in frozen] == ["T"] * 4, "SIGSTOP on all four while the row says frozen"
    assert all(r["state"] != "T" for r in before + after)
    check_columns(row, watch, group)
    check_reset(group)


def test_the_streams_row_stalls_r0_and_drops_r1_after_three_events(group, watch) -> None:
    row = pf.probe_stall_drop(group, 2, 1.0)
    (during,) = (phase["replicas"] for phase in watch["phases"])
    assert [r["faults"] for r in during] == [{"stall_after_chunks": 3}, {"drop_after_chunks": 3}, {}, {}]
    assert watch["configs"][0]["upstream"] == {"stream_idle_timeout_s": row["other"]["stream_idle_timeout_s"]}
    assert row["detail"]["ok"] == 0, "the streams row sends only streams"
    check_columns(row, watch, group)
    check_reset(group)


def test_the_aborts_row_counts_every_abort(group, watch, monkeypatch) -> None:
    labelled: collections.Counter[str] = collections.Counter()
    real = pf.abort_one

    def abort_one(*args: Any) -> str:
        kind = real(*args)
        labelled[kind] += 1
        return kind

    monkeypatch.setattr(pf, "abort_one", abort_one)
    row = pf.probe_aborts(group, 2, 10)
    detail, other = row["detail"], row["other"]
    assert row["sent"] == sum(detail.values()) == 10
    assert {k: v for k, v in detail.items() if v} == dict(labelled), "each stream counted where it stopped"
    # a stream read for at most 40 lines of a 60-token answer never finishes: each one is aborted
    assert detail["finished"] == 0 and detail["mid_stream"] > 0
    (gateway,) = watch["gateways"]
    fours = [m for m in watch["metrics"] if m[2] == {"status_class": "4xx"}]
    assert [(url, name) for url, name, _, _ in fours] == [(gateway, "prefix_gateway_requests_total")]
    assert other["aborts_counted_499"] == fours[0][3]
    assert detail["mid_stream"] <= other["aborts_counted_499"] <= 10  # each abort the gateway saw is a 499
    check_reset(group)


def test_an_abort_is_labelled_where_the_stream_really_stopped(group, monkeypatch) -> None:
    """Before the headers, mid-stream, or not at all: the give-up timeout alone says nothing."""
    monkeypatch.setattr(pf, "GIVE_UP_S", 0.5)  # well apart from the replicas' 10 ms per token
    slow, stalling, plain = group.urls[:3]
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "abort me"}], "stream": True}
    httpx.post(f"{slow}/sim/faults", json={"extra_latency_ms": 2000}).raise_for_status()  # no headers yet
    httpx.post(f"{stalling}/sim/faults", json={"stall_after_chunks": 2}).raise_for_status()  # headers, 2 events
    try:
        with httpx.Client(timeout=pf.CLIENT_TIMEOUT_S) as client:
            gave_up = {
                name: pf.abort_one(client, f"{url}/v1/chat/completions", {**body, "max_tokens": 3}, None)
                for name, url in (("slow", slow), ("stalling", stalling), ("plain", plain))
            }
            long = {**body, "max_tokens": 60}
            read = [pf.abort_one(client, f"{plain}/v1/chat/completions", long, n) for n in (0, 5)]
            bad = pf.abort_one(client, f"{plain}/v1/chat/completions", {**body, "model": "no-such-model"}, 5)
    finally:
        for url in (slow, stalling):
            httpx.post(f"{url}/sim/faults", json={"reset": True}).raise_for_status()
    assert gave_up == {"slow": "before_headers", "stalling": "mid_stream", "plain": "finished"}
    assert read == ["mid_stream", "mid_stream"]
    assert bad == "errors", "an error answer is no abort"
    check_reset(group)


def test_hung_requests_are_client_failures_in_the_row_and_in_the_table(monkeypatch, tmp_path, capsys) -> None:
    tally = Tally(sent=7, ok=3, stream_ok=1, hung=2)
    tally.failed["503"] = 1
    monkeypatch.setattr(pf, "metric", lambda gw, name, **labels: 0.0)
    made = pf.row("made up", SimpleNamespace(tally=tally), None)
    assert made["client_failures"] == 3 == made["sent"] - tally.ok - tally.stream_ok and made["hung"] == 2

    class NoGroup:  # main's replicas, never used: the row is made up
        def __init__(self, *args: Any, **options: Any) -> None:
            self.replicas: list[Any] = []

        def __enter__(self) -> NoGroup:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def dead(self) -> list[int]:
            return []

        def wait_healthy(self, timeout: float) -> None:
            pass

    monkeypatch.setattr(pf, "ReplicaGroup", NoGroup)
    monkeypatch.setattr(pf, "probe_kill", lambda group, c, seconds: made)
    monkeypatch.setattr(sys, "argv", ["probe_faults.py", "--rows", "kill", "--out", str(tmp_path / "p.json")])
    pf.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    header, values = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines)
    cells = dict(zip(header, values, strict=True))
    assert cells["client-visible failures"] == "3" and cells["of which hung"] == "2"
    assert cells["of which error events"] == "0" and cells["gateway 5xx"] == "0"


def test_main_runs_the_rows_asked_for_and_writes_its_table_and_json(group, monkeypatch, tmp_path, capsys) -> None:
    class Shared:  # the module's group in place of main's own: four replicas with the same options
        def __init__(self, n: int, log_dir: str, **options: Any) -> None:
            assert n == 4 and options == pf.SIM

        def __enter__(self) -> ReplicaGroup:
            return group

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(pf, "ReplicaGroup", Shared)
    out = tmp_path / "probe.json"
    argv = ["probe_faults.py", "--rows", "aborts", "--concurrency", "1", "--aborts", "6", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    pf.main()
    result = json.loads(out.read_text())
    assert result["args"]["rows"] == "aborts" and result["args"]["aborts"] == 6
    (row,) = result["rows"]
    assert row["probe"] == "6 streams aborted at random points (c=2)"  # 2 x --concurrency clients
    assert set(row) == {"probe", "sent", "client_failures", "error_events", "gateway_5xx", "hung", "detail", "other"}
    text = capsys.readouterr().out
    assert (
        "| probe | sent | client-visible failures | of which error events | of which hung | gateway 5xx | other |"
        in text
    )
    assert f"| {row['probe']} | 6 | None | None | 0 | {row['gateway_5xx']} |" in text
    assert f"wrote {out}" in text
    monkeypatch.setattr(sys, "argv", ["probe_faults.py", "--rows", "kill,nope"])
    with pytest.raises(SystemExit):
        pf.main()
    assert "unknown rows: nope" in capsys.readouterr().err
