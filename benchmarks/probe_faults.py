"""Rerun the resilience rows of the hardening probe table (issue 11) and count every failure column.

Rows: SIGKILL 1 of 4 replicas under mixed load (restarted midway); one replica answering 30 %
503s while another is 2 s slow; all replicas frozen (SIGSTOP); streams that stall or drop;
streams aborted by the client at random points.  Four simulated replica processes (real
time, streams of a few hundred ms) behind a gateway served in this process; load from threads
with the ``openai`` SDK (no SDK retries).  Prints the table and writes
``benchmarks/results/probe_faults.json``.

    python benchmarks/probe_faults.py                  # every row, modest sizes
    python benchmarks/probe_faults.py --rows kill,frozen --concurrency 16 --seconds 30

Columns: ``sent``; ``client failures`` (every request that did not get its answer:
non-streaming errors + streams refused before their first byte + streams ended by an error
event + streams cut without one + hung requests, so sent = answered + client failures);
``error events`` (part of the previous column: the only failure the issue accepts, for
streams in flight on a killed replica); ``gateway 5xx`` (the gateway's own
``requests_total{status_class="5xx"}``); ``hung`` (also part of the client failures: a request
that hit the 60 s client timeout is a failure its client saw, a minute late); ``other``
(row-specific numbers).

The aborts row counts where each aborted stream really stopped: ``before_headers`` (no
response yet), ``mid_stream`` (after the headers, before the end), ``finished`` (read to the
end: an impatient client whose 10 ms timeout never hit), ``errors`` (a non-200 answer or a
transport error).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.faultload import Load  # noqa: E402
from gateway.config import parse_config  # noqa: E402
from gateway.http.server import RunningGateway, serve_in_thread  # noqa: E402
from gateway.sim.launcher import ReplicaGroup  # noqa: E402

SIM = {
    "time_scale": 1.0,
    "decode_ms_per_token": 10,
    "prefill_tokens_per_s": 1_000_000,
    "enable_admin": True,
    "num_gpu_blocks": 8192,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}
CLIENT_TIMEOUT_S = 60.0
GIVE_UP_S = 0.01  # the aborts row's impatient clients: every connect, write or read wait


def gateway_config(urls: list[str], upstream: dict[str, Any] | None = None) -> Any:
    """Production defaults except a 1 s health interval (the issue's probes used the demo config)."""
    return parse_config(
        {
            "server": {"port": 0},
            "upstream": upstream or {},
            "health": {"interval_s": 1.0, "timeout_s": 1.0},
            "logging": {"summary_interval_s": 0, "access_log": False, "level": "error"},
            "replicas": [{"name": f"r{i}", "url": u} for i, u in enumerate(urls)],
            "routes": [{"name": "main", "policy": "prefix"}],
        },
        "<probe>",
    )


def metric(gw: RunningGateway, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{gw.url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def poll(check: Callable[[], object], timeout: float, what: str) -> float:
    """Seconds until ``check()`` is truthy (a deadline, never a fixed sleep)."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - start


def row(name: str, load: Load, gw: RunningGateway, **other: Any) -> dict[str, Any]:
    t = load.tally
    return {
        "probe": name,
        "sent": t.done,
        "client_failures": t.client_failures,  # hung included: sent - answered
        "error_events": sum(t.error_events.values()),
        "gateway_5xx": int(metric(gw, "prefix_gateway_requests_total", status_class="5xx")),
        "hung": t.hung,
        "detail": t.as_dict(),
        "other": other,
    }


def abort_one(client: httpx.Client, url: str, body: dict[str, Any], stop_after: int | None) -> str:
    """Send one stream and abort it; say where it really stopped (an aborts-row column).

    ``stop_after``: close it after reading that many lines; None: read on with a ``GIVE_UP_S``
    timeout on every wait, which may hit before the headers, mid-stream or never (the stream
    ends first), so the label comes from how far the stream got, not from the timeout.
    """
    headers = False
    try:
        timeout = httpx.Timeout(GIVE_UP_S) if stop_after is None else httpx.USE_CLIENT_DEFAULT
        with client.stream("POST", url, json=body, timeout=timeout) as resp:
            headers = True
            if resp.status_code != 200:
                return "errors"
            for i, _line in enumerate(resp.iter_lines()):
                if stop_after is not None and i >= stop_after:
                    return "mid_stream"
        return "finished"
    except httpx.TimeoutException:
        if stop_after is not None:  # the 60 s client timeout: a hang, not an abort
            return "errors"
        return "mid_stream" if headers else "before_headers"
    except httpx.HTTPError:
        return "errors"


def run_for(seconds: float, stop: threading.Event | None = None) -> None:
    """The scenario's length (a fault that lasts this long), not a wait for readiness."""
    (stop or threading.Event()).wait(seconds)


# -- rows ------------------------------------------------------------------------------------


def probe_kill(group: ReplicaGroup, c: int, seconds: float) -> dict[str, Any]:
    with serve_in_thread(gateway_config(group.urls)) as gw:
        load = Load(gw.openai_base_url, c, stream_share=0.5, max_tokens=40, timeout_s=CLIENT_TIMEOUT_S).start()
        run_for(seconds * 0.2)
        group.kill(1)
        run_for(seconds * 0.4)
        group.restart(1)
        readmit = poll(lambda: gw.gateway.replicas["r1"].healthy, 30, "r1 re-admitted")
        run_for(seconds * 0.4)
        load.stop(CLIENT_TIMEOUT_S + 10)
        return row(
            f"SIGKILL 1 of 4 under mixed load (c={c}, {seconds:g} s), restart after {seconds * 0.4:g} s",
            load,
            gw,
            readmitted_after_restart_s=round(readmit, 2),
            retries=int(metric(gw, "prefix_gateway_retries_total")),
        )


def probe_errors_and_slow(group: ReplicaGroup, c: int, seconds: float) -> dict[str, Any]:
    httpx.post(f"{group.urls[0]}/sim/faults", json={"error_rate": 0.3, "error_status": 503}).raise_for_status()
    httpx.post(f"{group.urls[1]}/sim/faults", json={"extra_latency_ms": 2000}).raise_for_status()
    try:
        with serve_in_thread(gateway_config(group.urls)) as gw:
            load = Load(gw.openai_base_url, c, stream_share=0.5, max_tokens=20, timeout_s=CLIENT_TIMEOUT_S).start()
            run_for(seconds)
            load.stop(CLIENT_TIMEOUT_S + 10)
            answered = load.tally.replicas
            slow = gw.gateway.replicas["r1"]
            return row(
                f"one replica 503s 30 %, another +2 s latency (c={c}, {seconds:g} s)",
                load,
                gw,
                retries=int(metric(gw, "prefix_gateway_retries_total")),
                non_streaming_answered_by=dict(answered),
                slow_replica_flagged=slow.slow,
                slow_replica_share=round(answered.get("r1", 0) / max(1, sum(answered.values())), 3),
            )
    finally:
        for url in group.urls[:2]:
            httpx.post(f"{url}/sim/faults", json={"reset": True}).raise_for_status()


def probe_frozen(group: ReplicaGroup, c: int, seconds: float) -> dict[str, Any]:
    with serve_in_thread(gateway_config(group.urls)) as gw:
        load = Load(gw.openai_base_url, c, stream_share=0.5, max_tokens=20, timeout_s=CLIENT_TIMEOUT_S).start()
        run_for(3)
        for r in group.replicas:
            r.signal(signal.SIGSTOP)
        try:
            run_for(seconds)
        finally:
            for r in group.replicas:
                r.signal(signal.SIGCONT)
        thawed = time.monotonic()
        client = httpx.Client(timeout=CLIENT_TIMEOUT_S)
        body = {"model": "demo-model", "messages": [{"role": "user", "content": "back?"}], "max_tokens": 1}
        status = client.post(f"{gw.openai_base_url}/chat/completions", json=body).status_code
        first_after = time.monotonic() - thawed
        back = poll(lambda: all(r.healthy for r in gw.gateway.replicas.values()), 30, "all healthy")
        run_for(3)
        load.stop(CLIENT_TIMEOUT_S + 10)
        return row(
            f"all 4 replicas frozen (SIGSTOP) {seconds:g} s (c={c})",
            load,
            gw,
            first_request_after_thaw_status=status,
            first_request_after_thaw_s=round(first_after, 3),
            all_marked_healthy_after_s=round(back + first_after, 2),
            panic_decisions=int(metric(gw, "prefix_gateway_route_panic_decisions_total")),
        )


def probe_stall_drop(group: ReplicaGroup, c: int, seconds: float) -> dict[str, Any]:
    httpx.post(f"{group.urls[0]}/sim/faults", json={"stall_after_chunks": 3}).raise_for_status()
    httpx.post(f"{group.urls[1]}/sim/faults", json={"drop_after_chunks": 3}).raise_for_status()
    try:
        # the default idle timeout is 30 s; 5 s keeps the row short
        config = gateway_config(group.urls, upstream={"stream_idle_timeout_s": 5.0})
        with serve_in_thread(config) as gw:
            load = Load(gw.openai_base_url, c, stream_share=1.0, max_tokens=20, timeout_s=CLIENT_TIMEOUT_S).start()
            run_for(seconds)
            load.stop(CLIENT_TIMEOUT_S + 10)
            drop, stall = gw.gateway.replicas["r1"], gw.gateway.replicas["r0"]
            return row(
                f"streams that stall after 3 events (r0) / drop after 3 events (r1) (c={c}, {seconds:g} s)",
                load,
                gw,
                stream_idle_timeout_s=5.0,
                dropping_replica_ejections=drop.ejections_total,
                dropping_replica_health_changes=drop.health_changes,
                dropping_replica_failures=drop.failures_total,
                stalling_replica_ejections=stall.ejections_total,
            )
    finally:
        for url in group.urls[:2]:
            httpx.post(f"{url}/sim/faults", json={"reset": True}).raise_for_status()


def probe_aborts(group: ReplicaGroup, c: int, count: int) -> dict[str, Any]:
    rng = random.Random(11)
    with serve_in_thread(gateway_config(group.urls)) as gw:
        url = f"{gw.openai_base_url}/chat/completions"
        lock = threading.Lock()
        todo = list(range(count))
        aborted = {"before_headers": 0, "mid_stream": 0, "finished": 0, "errors": 0}

        def worker(seed: int) -> None:
            local = random.Random(seed)
            client = httpx.Client(timeout=httpx.Timeout(CLIENT_TIMEOUT_S))
            while True:
                with lock:
                    if not todo:
                        break
                    n = todo.pop()
                body = {
                    "model": "demo-model",
                    "messages": [{"role": "user", "content": f"abort me {n}"}],
                    "max_tokens": 60,
                    "stream": True,
                }
                # a fifth give up after GIVE_UP_S of silence: before the answer, mid-stream or never
                stop_after = None if local.random() < 0.2 else local.randint(0, 40)
                kind = abort_one(client, url, body, stop_after)
                with lock:
                    aborted[kind] += 1
            client.close()

        threads = [threading.Thread(target=worker, args=(rng.random(),)) for _ in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        gateway_back = poll(lambda: all(r.in_flight == 0 for r in gw.gateway.replicas.values()), 30, "in-flight 0")

        def replicas_running() -> float:
            total = 0.0
            for u in group.urls:
                state = httpx.get(f"{u}/sim/state", timeout=10).json()
                total += state.get("running", 0) + state.get("waiting", 0)
            return total

        engines_back = poll(lambda: replicas_running() == 0, 30, "replicas idle")
        none_4xx = metric(gw, "prefix_gateway_requests_total", replica="none", status_class="4xx")
        all_4xx = metric(gw, "prefix_gateway_requests_total", status_class="4xx")
        return {
            "probe": f"{count} streams aborted at random points (c={c})",
            "sent": count,
            "client_failures": None,
            "error_events": None,
            "gateway_5xx": int(metric(gw, "prefix_gateway_requests_total", status_class="5xx")),
            "hung": 0,
            "detail": aborted,
            "other": {
                "gateway_in_flight_back_to_0_after_s": round(gateway_back, 2),
                "replica_running_back_to_0_after_s": round(engines_back, 2),
                "aborts_counted_499": int(all_4xx),
                "aborts_counted_with_replica_none": int(none_4xx),
            },
        }


ROWS = ("kill", "errors", "frozen", "streams", "aborts")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seconds", type=float, default=20.0, help="length of the kill/errors/streams rows")
    p.add_argument("--freeze-seconds", type=float, default=10.0)
    p.add_argument("--aborts", type=int, default=1000)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "probe_faults.json"))
    args = p.parse_args()
    wanted = [r for r in args.rows.split(",") if r]
    unknown = set(wanted) - set(ROWS)
    if unknown:
        p.error(f"unknown rows: {', '.join(sorted(unknown))}")
    results = []
    with tempfile.TemporaryDirectory() as logs, ReplicaGroup(4, log_dir=logs, **SIM) as group:
        for name in wanted:
            for r in group.replicas:
                r.signal(signal.SIGCONT)
            for index in group.dead():
                group.restart(index)
            group.wait_healthy(30)
            c, s = args.concurrency, args.seconds
            if name == "kill":
                result = probe_kill(group, c, s)
            elif name == "errors":
                result = probe_errors_and_slow(group, c, s)
            elif name == "frozen":
                result = probe_frozen(group, c, args.freeze_seconds)
            elif name == "streams":
                result = probe_stall_drop(group, c, s)
            else:
                result = probe_aborts(group, 2 * c, args.aborts)
            results.append(result)
            print(json.dumps(result), flush=True)
    print()
    # hung requests are client failures too (the docstring): their column sits under that one's
    print("| probe | sent | client-visible failures | of which error events | of which hung | gateway 5xx | other |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        other = ", ".join(f"{k}={v}" for k, v in r["other"].items())
        print(
            f"| {r['probe']} | {r['sent']} | {r['client_failures']} | {r['error_events']} | "
            f"{r['hung']} | {r['gateway_5xx']} | {other} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": results}, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
