"""Several gateway pods, measured: 1 gateway vs 3, with and without shared state (Redis),
and a gateway that joins mid-run, with and without catch-up.

    python benchmarks/bench_fleet.py --quick                  # smoke run: 2 workloads, small samples
    python benchmarks/bench_fleet.py                          # every workload, moderate load
    python benchmarks/bench_fleet.py --workload agent --size 0.5
    python benchmarks/bench_fleet.py --quick --mode join      # only the join rows

Behind a Kubernetes Service each request of a conversation may reach a different gateway pod.
This replays the policy benchmark's workloads (``bench_policies.py``: its workloads, simulated
fleet, load levels and replay machinery, imported, not copied) through:

- ``1 gateway``: one ``prefix`` gateway (the reference);
- ``3 gateways``: three, each on its own state (``state.backend: memory``);
- ``3 gateways + redis``: three sharing affinity and load through Redis.

The client spreads requests over the gateways in turn (``replay``'s multi-URL mode), as a
Service spreads connections.  Targets (issue 10), for ``3 gateways + redis`` against
``1 gateway``: hit rate at most 1 point lower, TTFT p50 at most 1.2x, prefill-work balance
(max/mean over replicas) at most 1.25.

Join mode (``--mode join``; ``--mode all``, the default, runs both): a new gateway process
joining mid-run must catch up from its peers (``gateway/state/catchup.py``) instead of routing
blind: its first minute's hit rate within 2 points of the others' (issue 10).  Two rows, each
on fresh gateways and emptied caches, byte-identical traffic:

- ``join, catch-up``: 2 gateways sharing Redis take the traffic; at ``--join-at`` (40 %) of
  the arrivals' span a 3rd gateway starts (same Redis channel, ``state.catch_up_keys`` at its
  default), and once its ``/ready`` answers the client spreads requests over all three, as a
  Service adds a pod once it is ready;
- ``join, blind``: the same with ``catch_up_keys: 0`` on every gateway (the peers send no
  snapshot; the joiner still gets every record made after it subscribed).

The joiner needs 1.5-5 s of wall time to start on a busy 2-core machine, while the policy
benchmark's samples last 3-7 s, so the join rows replay a larger sample of the same workload
(``--join-size``: 2.0 with ``--quick``, else 4.0; 12-28 s of arrivals).  It is started no
sooner than 5.5 s after its peers were ready: each gateway sends at most one snapshot per 5 s
and the peers swapped one when they met, so an earlier joiner would get none (a rate limit,
not what these rows measure; the JSON's ``peers_snapshot_records`` shows what was sent).

"The first minute" is on the simulated fleet's clock, as everywhere here: 60 simulated
seconds, i.e. ``60 x time_scale`` wall seconds (~6 s for the Mooncake replays, ~22 s for the
agent ones), from the joiner's first request.  When the arrivals end sooner (usual for the
agent workloads) the window is what is left of the run: the joiner's first K requests, every
one it got, and the JSON says so (``window.cut_by_end_of_run``, ``joiner.requests``).  Over
that window the joiner's hit rate (requests sent to its URL: ``replay`` records which URL
each request went to) is compared with the hit rate of the requests the other two gateways
got in the same window.  Verdict: ``others - joiner`` at most 2 points with catch-up (a
joiner doing better passes); the blind row's gap is reported beside it.

The gateway's own clocks are not scaled: the peers send their snapshot 1 s (wall) after the
joiner's first load report, and the joiner is ready before that, so its first ~1.3 s are
routed without the snapshot, which is ~2 % of a real minute but 6-20 % of the scaled one.
The JSON says when the snapshot landed (``snapshot_landed_s``, from the joiner's count of
applied peer records) and repeats the comparison from then on (``after_snapshot``).  Noise:
a window holds 50-200 joiner requests of very different prompt lengths, so each gap comes
with a bootstrap standard error (``gap_se_points``; ~5 points per run here); the verdict
says ``join_decided`` only when the gap is more than 2 standard errors from the target.
``--repeat N`` runs each row N times (alternating their order) and reports medians; it
averages out the machine's noise, not that one: the traffic is byte-identical, so the
joiner gets much the same requests every time (a larger ``--join-size`` does shrink it).

Redis: ``--redis-url`` (default ``$PREFIX_GATEWAY_TEST_REDIS_URL`` or 127.0.0.1:6379); when
none answers, a ``redis-server`` child is started as the tests do (``tests/redis_server.py``).
Results: a table on stdout and ``benchmarks/results/bench_fleet.json``, or
``bench_fleet_join.json`` with ``--mode join`` (``--out`` to choose).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from benchmarks import bench_policies as bp  # noqa: E402
from benchmarks.joiner import PEER_SNAPSHOT_INTERVAL_S, Joiner, admin_state, join_window  # noqa: E402
from benchmarks.processes import stop_all  # noqa: E402
from benchmarks.replay import WireRequest, median_of_runs, prepare  # noqa: E402
from benchmarks.workloads import WORKLOAD_NAMES, build  # noqa: E402
from tests.redis_server import start_redis  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_fleet.json"
RESULTS_JOIN = ROOT / "benchmarks" / "results" / "bench_fleet_join.json"  # --mode join alone
ROWS = ("1 gateway", "3 gateways", "3 gateways + redis")
JOIN_ROWS = ("join, catch-up", "join, blind")
# The control: a 3rd gateway that started with its peers (warm: it has shared their state all
# along) and is added to the client's list when that repetition's catch-up joiner became ready,
# so it gets much the same requests.  Its gap is what that subset of requests alone costs.
WARM_ROW = "join, warm control"
TARGETS = {"hit_rate_loss_points": 1.0, "ttft_p50_ratio": 1.2, "balance": 1.25, "join_gap_points": 2.0}
QUICK_WORKLOADS = ("agent", "mooncake_conversation")
MODES = ("all", "base", "join")
JOIN_AT = 0.4  # share of the arrivals' span after which the 3rd gateway starts
JOIN_SIZE = {"quick": 2.0, "full": 4.0}  # the join rows' sample (see the module docstring)
MINUTE_S = 60.0  # "the joiner's first minute", in simulated seconds


def start_gateway(name: str, replicas: Sequence[tuple[str, str]], workdir: Path, state: dict[str, Any] | None) -> Any:
    """``bench_policies.start_gateway`` (a prefix gateway, quiet logs), with ``state:`` added to its config."""
    extra = {"state": state} if state is not None else None
    return bp.start_gateway(bp.Variant(name, "prefix", "relocate"), replicas, workdir, extra)


def redis_state(redis_url: str, catch_up_keys: int | None = None) -> dict[str, Any]:
    """``state:`` for gateways sharing Redis, on a channel of their own (no run hears another's)."""
    state: dict[str, Any] = {"backend": "redis", "redis_url": redis_url, "channel": f"bench-fleet-{uuid.uuid4().hex}"}
    if catch_up_keys is not None:
        state["catch_up_keys"] = catch_up_keys
    return state


@contextmanager
def gateway_processes(
    n: int, replicas: Sequence[tuple[str, str]], workdir: Path, state: dict[str, Any] | None, tag: str
) -> Iterator[list[Any]]:
    """``n`` prefix gateways over the same replicas (optionally sharing ``state``), once all are ready."""
    procs: list[Any] = []
    try:
        for i in range(n):
            procs.append(start_gateway(f"{tag}-{i}", replicas, workdir, state))
        for gw in procs:
            bp.poll(gw.url + "/ready", 60, f"gateway {gw.name}")
        yield procs
    finally:
        stop_all(procs)


@contextmanager
def gateway_set(
    n: int, replicas: Sequence[tuple[str, str]], workdir: Path, state: dict[str, Any] | None, tag: str
) -> Iterator[list[str]]:
    """``gateway_processes``' URLs."""
    with gateway_processes(n, replicas, workdir, state, tag) as procs:
        yield [gw.url for gw in procs]


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


def pooled_prediction(stats: Sequence[dict[str, Any] | None]) -> float | None:
    """The gateways' predicted hit rate over all of them (their predicted cached tokens over the
    prompt tokens of the requests they predicted): each pod predicts from its own index, which
    holds its peers' records only when they share state, so this shows how well they do."""
    cached = prompt = 0
    for s in stats:
        if s is None or not s.get("predicted_prompt_tokens"):
            continue
        cached += s.get("predicted_cached_tokens") or 0
        prompt += s["predicted_prompt_tokens"]
    return cached / prompt if prompt else None


@dataclass(frozen=True)
class Sample:
    """One workload sample, ready to replay at the moderate level, and the clock it runs on."""

    name: str
    size: float
    wire: list[WireRequest]
    time_scale: float  # wall seconds per simulated second (the simulated fleet's clock)

    @property
    def span_s(self) -> float:
        return self.wire[-1].at if self.wire else 0.0

    @property
    def deadline_s(self) -> float:
        return self.span_s * bp.DEADLINE_FACTOR + bp.DEADLINE_SLACK_S


def sample(name: str, size: float, seed: int) -> Sample:
    """The policy benchmark's moderate level of ``name`` at ``size``."""
    wl = build(name, size=size, seed=seed)
    time_scale = bp.time_scale_for(wl, bp.SIM, bp.REPLICAS)
    factor = bp.time_factor_for(wl, bp.LOADS[wl.name]["moderate"], time_scale, bp.SIM, bp.REPLICAS)
    out = Sample(name, size, prepare(wl.requests, bp.MODEL, factor), time_scale)
    print(
        f"\n== {name} (size {size}): {len(out.wire)} requests over {out.span_s:.1f} s "
        f"(moderate load, time_scale {time_scale})"
    )
    return out


Fleet = tuple[list[tuple[str, str]], list[str], list[str]]  # (name, url) pairs, urls, names


@dataclass(frozen=True)
class Plan:
    """What to run, decided once from the command line."""

    mode: str  # all, base (1 vs 3 gateways) or join
    size: float  # sample size of the 1-vs-3 rows
    join_size: float  # sample size of the join rows
    join_at: float  # share of the join sample's span after which the 3rd gateway starts
    seed: int
    redis_url: str
    workdir: Path
    repeat: int = 1  # runs per row; the table shows their medians


@contextmanager
def fleet(smp: Sample, workdir: Path, tag: str) -> Iterator[Fleet]:
    """The simulated replicas on ``smp``'s clock: yields ((name, url) pairs, urls, names)."""
    from gateway.sim.launcher import run_replicas

    names = [f"r{i}" for i in range(bp.REPLICAS)]
    sim = {**bp.SIM, "time_scale": smp.time_scale}
    with run_replicas(bp.REPLICAS, log_dir=workdir / f"sims-{smp.name}-{tag}", **sim) as urls:
        yield list(zip(names, urls, strict=True)), list(urls), names


def _pct1(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def print_row(row: str, r: dict[str, Any]) -> None:
    print(
        f"  {row:<20} hit {100 * (r['hit_rate'] or 0):5.1f} % (predicted {_pct1(r.get('hit_rate_predicted'))})"
        f"  ttft p50 {r['ttft_p50_ms'] or 0:7.0f} ms  balance {r['balance'] or 0:4.2f}"
        f"  ok {r['ok']} errors {r['errors']}"
    )


def run_base(smp: Sample, plan: Plan) -> dict[str, Any]:
    """The three rows of 1 vs 3 gateways (module docstring); medians over ``--repeat`` runs."""
    out: dict[str, Any] = {"requests": len(smp.wire), "span_s": smp.span_s, "rows": {}}
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    with fleet(smp, plan.workdir, "base") as (replicas, urls, names):
        for _ in range(plan.repeat):
            for row in ROWS:
                n = 1 if row == "1 gateway" else 3
                state = redis_state(plan.redis_url) if row.endswith("redis") else None
                tag = row.replace(" ", "_").replace("+", "")
                with gateway_set(n, replicas, plan.workdir, state, tag) as gateway_urls:
                    summary = bp.run_once(smp.wire, gateway_urls, urls, names, smp.deadline_s, via_gateway=True)
                    predicted = pooled_prediction([bp.gateway_stats(u) for u in gateway_urls])
                runs[row].append({**row_numbers(summary), "hit_rate_predicted": predicted})
                print_row(row, runs[row][-1])
    out["rows"] = {row: median_of_runs(runs[row]) for row in ROWS}
    if plan.repeat > 1:
        out["runs"] = runs
    return out


# -- a gateway joining mid-run ------------------------------------------------------------------


def run_join_row(
    row: str, smp: Sample, fleet_: Fleet, state: dict[str, Any], plan: Plan, warm_at_s: float | None = None
) -> dict[str, Any]:
    """2 gateways, then a 3rd joining at ``plan.join_at`` of the span: the run's numbers and the join window.

    ``warm_at_s``: the control row (``WARM_ROW``): the 3rd gateway starts with the other two and
    is only added to the client's list at that time.
    """
    replicas, urls, names = fleet_
    tag = row.replace(" ", "_").replace(",", "")
    warm = warm_at_s is not None
    with gateway_processes(3 if warm else 2, replicas, plan.workdir, state, tag) as procs:
        peers = [gw.url for gw in procs[:2]]
        if warm:
            joiner = Joiner(lambda: procs[2], warm_at_s, bp.ADMIN_KEY)
        else:
            launch = lambda: start_gateway(f"{tag}-joiner", replicas, plan.workdir, state)  # noqa: E731
            joiner = Joiner(launch, smp.span_s * plan.join_at, bp.ADMIN_KEY)
            # the peers met (and swapped snapshots) about a second after they were ready
            joiner.not_before = time.monotonic() + PEER_SNAPSHOT_INTERVAL_S + 0.5
        try:
            summary = bp.run_once(
                smp.wire, peers, urls, names, smp.deadline_s, via_gateway=True, replayer=joiner.replay
            )
            sent = [admin_state(u, bp.ADMIN_KEY) for u in peers]
        finally:
            joiner.stop()
    records = [int(s.get("records_sent") or 0) for s in sent]
    landed = joiner.snapshot_landed_s(records)
    outcomes = joiner.result.outcomes if joiner.result is not None else []
    return {
        **row_numbers(summary),
        "join": {
            "launched_s": joiner.launched_s,
            "ready_s": joiner.ready_s,
            "snapshot_landed_s": landed,
            "applied_at_ready": joiner.applied_at_ready,
            "peers_snapshot_records": joiner.records_since_launch(records),
            "error": joiner.error,
        },
        **join_window(outcomes, joiner.url, MINUTE_S * smp.time_scale, smp.span_s, landed),
    }


def run_join(smp: Sample, plan: Plan) -> dict[str, Any]:
    """The join rows (module docstring): catch-up at its default, and blind (``catch_up_keys: 0``).

    With ``--repeat`` the rows alternate in order from one repetition to the next (a slow
    moment on the machine hits both) and each number is the median of the runs.
    """
    out: dict[str, Any] = {
        "size": smp.size,
        "requests": len(smp.wire),
        "span_s": smp.span_s,
        "time_scale": smp.time_scale,
        "join_at_s": round(smp.span_s * plan.join_at, 3),
        "rows": {},
        "runs": {row: [] for row in (*JOIN_ROWS, WARM_ROW)},
    }
    with fleet(smp, plan.workdir, "join") as fleet_:
        for rep in range(plan.repeat):
            for row in JOIN_ROWS if rep % 2 == 0 else JOIN_ROWS[::-1]:
                state = redis_state(plan.redis_url, catch_up_keys=0 if row.endswith("blind") else None)
                r = run_join_row(row, smp, fleet_, state, plan)
                out["runs"][row].append(r)
                print_row(row, r)
                print(f"  {'':<20} {join_line(r)}")
            ready_s = out["runs"][JOIN_ROWS[0]][-1]["join"]["ready_s"]
            if ready_s is not None:
                r = run_join_row(WARM_ROW, smp, fleet_, redis_state(plan.redis_url), plan, warm_at_s=ready_s)
                out["runs"][WARM_ROW].append(r)
                print_row(WARM_ROW, r)
                print(f"  {'':<20} {join_line(r)}")
    out["rows"] = {row: median_of_runs(runs) for row, runs in out["runs"].items() if runs}
    return out


def join_line(r: dict[str, Any]) -> str:
    """One row's join window in words (the table and the progress lines)."""
    j, w = r["join"], r.get("window")
    if w is None:
        return f"the joiner served no request (ready at {j['ready_s']} s; {j['error'] or 'the run ended first'})"
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f} %"  # noqa: E731
    cut = ", cut by the end of the run" if w["cut_by_end_of_run"] else ""
    landed = j["snapshot_landed_s"]
    snapshot = "no snapshot" if landed is None else f"snapshot landed {landed - j['ready_s']:+.1f} s from ready"
    text = (
        f"launched at {j['launched_s']:.1f} s, ready at {j['ready_s']:.1f} s ({snapshot}); "
        f"window {w['start_s']:.1f}-{w['end_s']:.1f} s{cut}: "
        f"joiner {pct(r['joiner']['hit_rate'])} over {r['joiner']['requests']} requests, "
        f"others {pct(r['others']['hit_rate'])} over {r['others']['requests']}: "
        f"gap {r['gap_points']} ± {r['gap_se_points']} pts"
    )
    after = r.get("after_snapshot")
    if after is not None:
        text += f"; after the snapshot: {after['gap_points']} ± {after['gap_se_points']} pts"
    return text


# -- verdicts and report ------------------------------------------------------------------------


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


def join_verdict(join: dict[str, Any]) -> dict[str, Any]:
    """With catch-up, the joiner at most ``join_gap_points`` below the others; the blind gap beside it.

    The raw gap mixes two things: what the joiner did not know, and which requests it happened
    to get (a few hundred of very different lengths and reuse; the traffic is byte-identical
    from run to run, so the same subset each time).  The warm control (``WARM_ROW``) gets much
    the same subset on a gateway that knows everything; ``join_excess_gap_points``, the median
    over repetitions of (catch-up gap - control gap), is the joiner's own shortfall, and the
    verdict.  Without the control (no repetition finished one) the raw gap decides.
    """
    caught_up, blind = (join["rows"][r] for r in JOIN_ROWS)
    gap, se = caught_up["gap_points"], caught_up["gap_se_points"]
    paired = [
        round(c["gap_points"] - w["gap_points"], 2)
        for c, w in zip(join["runs"][JOIN_ROWS[0]], join["runs"].get(WARM_ROW, []), strict=False)
        if c["gap_points"] is not None and w["gap_points"] is not None
    ]
    excess = round(statistics.median(paired), 2) if paired else None
    judged = excess if excess is not None else gap
    control = join["rows"].get(WARM_ROW)
    return {
        "join_gap_points": gap,
        # one run's (median over runs): repetitions replay the same traffic, and the joiner gets
        # much the same requests each time, so they do not average this sampling noise away
        "join_gap_se_points": se,
        # the sample decides only when the gap is more than 2 standard errors from the target
        "join_decided": judged is not None and se is not None and abs(judged - TARGETS["join_gap_points"]) > 2 * se,
        "join_blind_gap_points": blind["gap_points"],
        "join_control_gap_points": control["gap_points"] if control else None,
        "join_excess_gap_points": excess,
        "join_excess_gap_runs": paired,
        "join_joiner_requests": caught_up["joiner"]["requests"],
        "join_gap_runs": [r["gap_points"] for r in join["runs"][JOIN_ROWS[0]]],
        "join_blind_gap_runs": [r["gap_points"] for r in join["runs"][JOIN_ROWS[1]]],
        "pass": {"join": judged is not None and judged <= TARGETS["join_gap_points"]},
    }


def merge_verdicts(*parts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"pass": {}}
    for part in parts:
        out.update({k: v for k, v in part.items() if k != "pass"})
        out["pass"].update(part["pass"])
    return out


def run_workload(name: str, plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    verdicts = []
    if plan.mode in ("all", "base"):
        out.update(run_base(sample(name, plan.size, plan.seed), plan))
        verdicts.append(verdict(*(out["rows"][r] for r in (ROWS[0], ROWS[2], ROWS[1]))))
    if plan.mode in ("all", "join"):
        out["join"] = run_join(sample(name, plan.join_size, plan.seed), plan)
        verdicts.append(join_verdict(out["join"]))
    out["verdict"] = merge_verdicts(*verdicts)
    return out


def _mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'workload':<24}{'row':<22}{'hit %':>7}{'pred %':>8}{'ttft p50 ms':>13}{'p90 ms':>9}{'balance':>9}"
        f"{'errors':>8}",
    ]

    def row_line(name: str, row: str, r: dict[str, Any]) -> str:
        return (
            f"{name:<24}{row:<22}{100 * (r['hit_rate'] or 0):>7.1f}{_pct1(r.get('hit_rate_predicted')):>8}"
            f"{r['ttft_p50_ms'] or 0:>13.0f}"
            f"{r['ttft_p90_ms'] or 0:>9.0f}{r['balance'] or 0:>9.2f}{r['errors']:>8}"
        )

    for name, wres in results["workloads"].items():
        v = wres["verdict"]
        for row, r in (wres.get("rows") or {}).items():
            lines.append(row_line(name, row, r))
        if "rows" in wres:
            lines.append(
                f"{'':<24}redis vs 1 gateway: hit loss {v['redis_hit_rate_loss_points']} pts (target <= 1, "
                f"{_mark(v['pass']['hit_rate'])}), ttft p50 x{v['redis_ttft_p50_ratio']} (<= 1.2, "
                f"{_mark(v['pass']['ttft_p50'])}), balance {v['redis_balance']} (<= 1.25, "
                f"{_mark(v['pass']['balance'])}); "
                f"without sharing: hit loss {v['no_sharing_hit_rate_loss_points']} pts"
            )
        if "join" in wres:
            join = wres["join"]
            lines.append(
                f"{'':<24}join sample: size {join['size']:g}, {join['requests']} requests over "
                f"{join['span_s']:.1f} s, the 3rd gateway due at {join['join_at_s']:.1f} s"
            )
            for row, r in join["rows"].items():
                lines.append(row_line(name, row, r))
                lines.append(f"{'':<26}{join_line(r)}")
            lines.append(
                f"{'':<24}joiner vs the others, first minute: gap {v['join_gap_points']} "
                f"± {v['join_gap_se_points']} pts with catch-up, {v['join_blind_gap_points']} blind, "
                f"{v['join_control_gap_points']} for the warm control on the same requests; "
                f"catch-up beyond the control: {v['join_excess_gap_points']} pts (target <= "
                f"{TARGETS['join_gap_points']:g}, {_mark(v['pass']['join'])}"
                f"{'' if v['join_decided'] else ', within noise'}); "
                f"runs: {v['join_gap_runs']} with catch-up, {v['join_blind_gap_runs']} blind, "
                f"{v['join_excess_gap_runs']} beyond the control"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_WORKLOADS)}, small samples")
    parser.add_argument("--workload", action="append", choices=WORKLOAD_NAMES)
    parser.add_argument("--mode", choices=MODES, default="all", help="base: 1 vs 3 gateways; join: a gateway joins")
    parser.add_argument("--size", type=float, default=None, help="sample size of the 1-vs-3 rows")
    parser.add_argument("--join-size", type=float, default=None, help="sample size of the join rows")
    parser.add_argument("--join-at", type=float, default=JOIN_AT, help="share of the span when the 3rd gateway starts")
    parser.add_argument("--repeat", type=int, default=1, help="runs per row; the table shows medians")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default: see the module docstring)")
    args = parser.parse_args(argv)
    workloads = args.workload or (list(QUICK_WORKLOADS) if args.quick else list(WORKLOAD_NAMES))
    size = args.size if args.size is not None else (bp.QUICK_SIZE if args.quick else 1.0)
    join_size = args.join_size if args.join_size is not None else JOIN_SIZE["quick" if args.quick else "full"]
    t0 = time.monotonic()
    redis = start_redis(args.redis_url)
    if redis.url is None:
        print(f"no Redis: {redis.reason}")
        return 2
    results: dict[str, Any] = {
        "meta": {
            "command": " ".join(["python", "benchmarks/bench_fleet.py", *(sys.argv[1:] if argv is None else argv)]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "mode": args.mode,
            "size": size,
            "join_size": join_size,
            "join_at": args.join_at,
            "seed": args.seed,
            "repeat": args.repeat,
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
            plan = Plan(args.mode, size, join_size, args.join_at, args.seed, redis.url, Path(tmp), args.repeat)
            for name in workloads:
                results["workloads"][name] = run_workload(name, plan)
    finally:
        redis.stop()
    results["meta"]["elapsed_s"] = round(time.monotonic() - t0, 1)
    results["meta"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    out = args.out or (RESULTS_JOIN if args.mode == "join" else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print("\n" + table(results))
    print(f"\nwrote {out} in {results['meta']['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
