"""Turn the policy benchmark's results into tables, target verdicts and PNG charts.

Input is the results document written by ``bench_policies.py`` (also stored as JSON)::

    {"meta": {...}, "missing_policies": [...],
     "workloads": {NAME: {"summary": {...}, "levels": {LEVEL: {"runs": {POLICY: RunSummary},
                                                               "oracle": RunSummary | None, ...}}}}}

Everything here is pure (no servers), so it is unit-tested and can re-render a stored JSON:
``python benchmarks/report.py benchmarks/results/bench_policies.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BASELINE = "round_robin"  # context only: its ratios stay in the table, no target uses them
CANDIDATE = "prefix"
LOAD_AWARE = "least_loaded"
PEER = "sglang"  # the Rust SGLang router, policy cache_aware (benchmarks/peer_sglang.py)
ORACLE = "oracle"
REFERENCE_ORACLE = "reference_oracle"  # the oracle on the same workload without its volatile header

# The targets of issue 8 ("Decisions on the targets"), in one place.
HIT_OF_ORACLE = 0.98
HIT_VS_PEER_POINTS = 0.005  # hit rate >= the peer's minus half a point
TTFT_VS_PEER_MODERATE = 0.8  # p50 and p90 at moderate load
P90_VS_ORACLE_SATURATED = 1.3
WORK_BALANCE = 1.25  # max/mean over replicas of uncached prompt tokens
CONTROL_TOLERANCE = 1.05
LOAD_BOUND_C = 1.25  # the in-flight bound shown in the table (information, not a target)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One target on one workload/load level."""

    workload: str
    level: str
    target: str
    value: float | None
    threshold: float | None
    passed: bool | None  # None = not applicable / not measurable in this run
    detail: str

    @property
    def label(self) -> str:
        return {True: "PASS", False: "FAIL", None: "n/a"}[self.passed]


def _get(run: Mapping[str, Any] | None, *path: str) -> Any:
    cur: Any = run
    for key in path:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(key)
    return cur


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or (isinstance(b, float) and math.isnan(b)):
        return None
    if isinstance(a, float) and math.isnan(a):
        return None
    return a / b


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def paired(
    cand: Mapping[str, Any] | None,
    ref: Mapping[str, Any] | None,
    path: Sequence[str],
    op: Callable[[float | None, float | None], float | None] = _ratio,
) -> float | None:
    """``op(candidate, reference)`` on one metric, the median over repetitions when both cells
    were repeated: each repetition's two runs shared the machine's moment, so their ratio is
    paired; a ratio of two medians could mix a quiet run with a busy one."""
    reps_c, reps_r = _get(cand, "repeats"), _get(ref, "repeats")
    if isinstance(reps_c, list) and isinstance(reps_r, list) and len(reps_c) == len(reps_r) and reps_c:
        values = [op(_get(c, *path), _get(r, *path)) for c, r in zip(reps_c, reps_r, strict=True)]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None
    return op(_get(cand, *path), _get(ref, *path))


def evaluate(workload: str, levels: Mapping[str, Mapping[str, Any]], control: bool) -> list[Verdict]:
    """Issue 8's targets on the ``prefix`` row of one workload, level by level.

    Hit rate vs the pooled oracle and vs the SGLang router; TTFT vs the SGLang router at
    moderate load and vs the oracle at saturated load; prefill-work balance; for the control
    workload (nothing shareable) TTFT vs ``least_loaded`` instead of the hit-rate and TTFT
    targets; for a workload with a header-less reference, hit rate vs the oracle on that
    reference.  Verdicts use medians of repetitions (see :func:`paired`).
    """
    out: list[Verdict] = []
    for level, data in levels.items():
        runs = data.get("runs", {})
        cand = runs.get(CANDIDATE)
        oracle = data.get(ORACLE)
        peer = runs.get(PEER)
        if peer is not None and "error" in peer:
            peer = None

        def verdict(
            target: str, value: float | None, threshold: float, ok: bool, detail: str, level: str = level
        ) -> Verdict:
            return Verdict(workload, level, target, value, threshold, ok, detail)

        def na(target: str, why: str, level: str = level) -> Verdict:
            return Verdict(workload, level, target, None, None, None, why)

        if cand is None or "error" in cand:
            out.append(na("all targets", f"policy {CANDIDATE!r} {'failed to start' if cand else 'not run'}"))
            continue
        hit = _get(cand, "hit_rate")
        if not control:
            # 1. hit rate vs the pooled oracle
            name = f"hit >= {HIT_OF_ORACLE:.0%} of oracle"
            share = paired(cand, oracle, ["hit_rate"])
            if share is None:
                out.append(na(name, "oracle or hit rate not measured"))
            else:
                detail = f"{hit:.1%} vs oracle {_get(oracle, 'hit_rate'):.1%} = {share:.1%}"
                out.append(verdict(name, share, HIT_OF_ORACLE, share >= HIT_OF_ORACLE, detail))
            # 1b. hit rate vs the oracle on the same traffic without its volatile header
            reference = data.get(REFERENCE_ORACLE)
            if reference is not None:
                name = f"hit >= {HIT_OF_ORACLE:.0%} of oracle without the header"
                share = paired(cand, reference, ["hit_rate"])
                if share is None:
                    out.append(na(name, "reference oracle not measured"))
                else:
                    detail = f"{hit:.1%} vs {_get(reference, 'hit_rate'):.1%} = {share:.1%}"
                    out.append(verdict(name, share, HIT_OF_ORACLE, share >= HIT_OF_ORACLE, detail))
            # 2. hit rate vs the peer router
            name = f"hit >= {PEER} - {HIT_VS_PEER_POINTS * 100:.1f} pts"
            delta = paired(cand, peer, ["hit_rate"], _diff) if peer else None
            if delta is None:
                out.append(na(name, f"{PEER} not run"))
            else:
                detail = f"{hit:.1%} vs {PEER} {_get(peer, 'hit_rate'):.1%}: {delta * 100:+.1f} pts"
                out.append(verdict(name, delta, -HIT_VS_PEER_POINTS, delta >= -HIT_VS_PEER_POINTS, detail))
            # 3. TTFT: vs the peer at moderate load, vs the oracle at saturated load
            if level == "moderate":
                for q in ("p50", "p90"):
                    name = f"TTFT {q} <= {TTFT_VS_PEER_MODERATE}x {PEER}"
                    r = paired(cand, peer, ["ttft_ms", q]) if peer else None
                    if r is None:
                        out.append(na(name, f"{PEER} not run"))
                    else:
                        ok = r <= TTFT_VS_PEER_MODERATE
                        # context: a target below the pooled oracle's own ratio is out of any router's reach
                        bound = paired(oracle, peer, ["ttft_ms", q])
                        pooled = f" (pooled oracle: {bound:.2f}x)" if bound is not None else ""
                        out.append(verdict(name, r, TTFT_VS_PEER_MODERATE, ok, f"{r:.2f}x of {PEER}{pooled}"))
            elif level == "saturated":
                name = f"TTFT p90 <= {P90_VS_ORACLE_SATURATED}x oracle"
                r = paired(cand, oracle, ["ttft_ms", "p90"])
                if r is None:
                    out.append(na(name, "oracle not measured"))
                else:
                    ok = r <= P90_VS_ORACLE_SATURATED
                    theirs = paired(peer, oracle, ["ttft_ms", "p90"]) if peer else None
                    context = f" ({PEER}: {theirs:.2f}x)" if theirs is not None else ""
                    out.append(verdict(name, r, P90_VS_ORACLE_SATURATED, ok, f"{r:.2f}x of the oracle{context}"))
        else:
            ll = runs.get(LOAD_AWARE)
            for q in ("p50", "p90"):
                name = f"TTFT {q} within 5% of {LOAD_AWARE}"
                r = paired(cand, ll, ["ttft_ms", q]) if ll else None
                if r is None:
                    out.append(na(name, f"{LOAD_AWARE} not run"))
                else:
                    out.append(verdict(name, r, CONTROL_TOLERANCE, r <= CONTROL_TOLERANCE, f"{r:.2f}x"))
        # 4. balance on work: uncached prompt tokens per replica, max/mean
        name = f"prefill-work max/mean <= {WORK_BALANCE}"
        balance = _get(cand, "prefill_work", "max_over_mean")
        if balance is None:
            out.append(na(name, "no prefill work measured"))
        else:
            per = _get(cand, "prefill_work", "per_replica") or {}
            spread = ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in per.items())
            in_flight = _get(cand, "load", "max_over_mean")
            detail = f"{balance:.2f} ({spread}); in-flight max/mean {_fmt(in_flight, '.2f')} (information)"
            out.append(verdict(name, balance, WORK_BALANCE, balance <= WORK_BALANCE, detail))
    return out


# -- tables -----------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".0f", none: str = "-") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    return format(value, spec)


def _row(
    name: str,
    run: Mapping[str, Any],
    oracle: Mapping[str, Any] | None,
    peer: Mapping[str, Any] | None,
    rr: Mapping[str, Any] | None,
) -> list[str]:
    hit = run.get("hit_rate")
    ttft = run.get("ttft_ms") or {}
    load = run.get("load") or {}
    censored = run.get("ttft_censored") or 0
    mark = ">" if censored else ""  # percentiles include lower bounds for unfinished requests
    vs_peer = paired(run, peer, ["hit_rate"], _diff) if peer is not None else None
    return [
        name,
        _fmt(hit, ".1%"),
        _fmt(run.get("hit_rate_predicted"), ".1%"),  # the gateway's own prediction (its rows only)
        _fmt(paired(run, oracle, ["hit_rate"]), ".1%"),
        _fmt(vs_peer * 100 if vs_peer is not None else None, "+.1f"),
        mark + _fmt(ttft.get("p50")),
        mark + _fmt(ttft.get("p90")),
        mark + _fmt(ttft.get("p99")),
        _fmt(paired(run, peer, ["ttft_ms", "p50"]) if peer is not None else None, ".2f") + "x",
        _fmt(paired(run, peer, ["ttft_ms", "p90"]) if peer is not None else None, ".2f") + "x",
        _fmt(paired(run, oracle, ["ttft_ms", "p90"]), ".2f") + "x",
        _fmt(_get(run, "prefill_work", "max_over_mean"), ".2f"),
        _fmt(load.get("max_over_mean"), ".2f"),
        _fmt(load.get("assign_certain_ok_share"), ".0%"),
        _fmt(run.get("throughput_rps"), ".1f"),
        _fmt(run.get("router_cpu_ms_per_request"), ".1f"),
        _fmt(paired(run, rr, ["ttft_ms", "p50"]), ".2f") + "x",
        _fmt(paired(run, rr, ["ttft_ms", "p90"]), ".2f") + "x",
        _ok_sent(run),
    ]


def _ok_sent(run: Mapping[str, Any]) -> str:
    text = f"{run.get('ok', 0)}/{run.get('requests', 0)}"
    return text + (f" ({run['unfinished']} cut)" if run.get("unfinished") else "")


HEADERS = [
    "policy",
    "hit rate",
    "predicted",
    "% oracle",
    f"vs {PEER} pts",
    "TTFT p50",
    "p90",
    "p99 ms",
    f"p50/{PEER}",
    f"p90/{PEER}",
    "p90/oracle",
    "work max/mean",
    "in-flight max/mean",
    "bound@assign",
    "req/s",
    "router CPU ms/req",
    "p50/RR",
    "p90/RR",
    "ok/sent",
]


def _render(rows: Sequence[Sequence[str]], headers: Sequence[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    return "\n".join([line, sep, *body])


def level_table(level_data: Mapping[str, Any]) -> str:
    """Markdown table of one workload at one load level: every policy, then the oracle."""
    runs = level_data.get("runs", {})
    oracle = level_data.get(ORACLE)
    rr = runs.get(BASELINE)
    peer = runs.get(PEER)
    if peer is not None and "error" in peer:
        peer = None
    rows = [
        _row(name, run, oracle, peer, rr)
        if "error" not in run
        else [name, "failed to start", *[""] * (len(HEADERS) - 2)]
        for name, run in runs.items()
    ]
    if oracle:
        rows.append(_row("oracle (pooled)", oracle, oracle, peer, rr))
    reference = level_data.get(REFERENCE_ORACLE)
    if reference:
        rows.append(_row("oracle, no header", reference, oracle, peer, rr))
    return _render(rows, HEADERS)


def summary_table(results: Mapping[str, Any]) -> str:
    """One line per workload and level for the ``prefix`` row: the numbers every target reads."""
    rows = []
    for wname, wl in results.get("workloads", {}).items():
        verdicts = [Verdict(**v) for v in wl.get("targets", [])]
        for level, data in wl.get("levels", {}).items():
            runs = data.get("runs", {})
            cand, peer, oracle = runs.get(CANDIDATE), runs.get(PEER), data.get(ORACLE)
            if cand is None or "error" in cand:
                continue
            if peer is not None and "error" in peer:
                peer = None
            delta = paired(cand, peer, ["hit_rate"], _diff) if peer else None
            mine = [v for v in verdicts if v.level == level]
            failed = [v.target for v in mine if v.passed is False]
            passed = sum(1 for v in mine if v.passed)
            rows.append(
                [
                    f"{wname} @ {level}",
                    _fmt(_get(cand, "hit_rate"), ".1%"),
                    _fmt(_get(oracle, "hit_rate"), ".1%"),
                    _fmt(paired(cand, oracle, ["hit_rate"]), ".1%"),
                    _fmt(paired(cand, data.get(REFERENCE_ORACLE), ["hit_rate"]), ".1%"),
                    _fmt(_get(peer, "hit_rate"), ".1%"),
                    _fmt(delta * 100 if delta is not None else None, "+.1f"),
                    _fmt(_get(cand, "ttft_ms", "p50")) + " / " + _fmt(_get(cand, "ttft_ms", "p90")),
                    _fmt(_get(peer, "ttft_ms", "p50")) + " / " + _fmt(_get(peer, "ttft_ms", "p90")),
                    _fmt(_get(oracle, "ttft_ms", "p50")) + " / " + _fmt(_get(oracle, "ttft_ms", "p90")),
                    _fmt(paired(cand, peer, ["ttft_ms", "p50"]) if peer else None, ".2f")
                    + " / "
                    + _fmt(paired(cand, peer, ["ttft_ms", "p90"]) if peer else None, ".2f"),
                    _fmt(paired(cand, oracle, ["ttft_ms", "p90"]), ".2f"),
                    _fmt(_get(cand, "prefill_work", "max_over_mean"), ".2f"),
                    f"{passed}/{passed + len(failed)} pass" + (f"; FAIL: {', '.join(failed)}" if failed else ""),
                ]
            )
    headers = [
        "workload @ level",
        "prefix hit",
        "oracle hit",
        "% oracle",
        "% oracle w/o header",
        f"{PEER} hit",
        "vs pts",
        "prefix TTFT p50/p90",
        f"{PEER} TTFT",
        "oracle TTFT",
        f"p50 / p90 vs {PEER}",
        "p90/oracle",
        "work max/mean",
        "verdicts",
    ]
    return _render(rows, headers) if rows else "(no prefix runs)"


def verdict_table(verdicts: Sequence[Verdict]) -> str:
    rows = [[v.level, v.target, v.label, v.detail] for v in verdicts]
    return _render(rows, ["load", "target", "result", "measured"]) if rows else "(no targets)"


def render_text(results: Mapping[str, Any]) -> str:
    """The whole console/markdown report."""
    meta = results.get("meta", {})
    parts = []
    if meta.get("date"):
        parts.append(
            f"Run {meta['date']} on {meta.get('cpus', '?')} CPUs, git {meta.get('git')}, "
            f"{meta.get('elapsed_s', '?')} s: `{meta.get('command', '')}`"
            + (
                f" (load average {meta['loadavg_start'][0]} at the start, {meta['loadavg_end'][0]} at the end)"
                if meta.get("loadavg_start") and meta.get("loadavg_end")
                else ""
            )
        )
    sim = meta.get("sim", {})
    if sim:
        parts.append(
            "Simulated fleet: {replicas} replicas x {num_gpu_blocks} KV blocks of {block_size} tokens, "
            "prefill {prefill_tokens_per_s:.0f} tok/s, decode {decode_ms_per_token} ms/token, "
            "max_num_seqs {max_num_seqs}; time_scale (wall = simulated x time_scale) is set per workload; "
            "oracle: 1 replica with {oracle_blocks} blocks and the fleet's pooled compute.".format(
                replicas=meta.get("replicas", "?"), oracle_blocks=meta.get("oracle_blocks", "?"), **sim
            )
        )
    if meta.get("sglang_router") or meta.get("tokenizers"):
        tok = meta.get("tokenizers") or {}
        parts.append(
            f"sglang-router {meta.get('sglang_router') or 'not installed'}; replicas tokenize with "
            f"{tok.get('sim') or '?'}, the gateway's tokenizer setting is {tok.get('gateway') or '?'}."
        )
    if results.get("missing_policies"):
        parts.append("Policies not available in this checkout (skipped): " + ", ".join(results["missing_policies"]))
    if meta.get("mode"):
        parts.append(f"Mode: {meta['mode']}")
    if (meta.get("repeat") or 1) > 1:
        parts.append(
            f"Each cell: the median of {meta['repeat']} runs, metric by metric (every run is kept in the JSON)."
        )
    for name, wl in results.get("workloads", {}).items():
        summary = wl.get("summary", {})
        parts.append(f"\n## {name}: {wl.get('description', '')}")
        parts.append(
            f"{summary.get('requests')} requests (first level's sample), "
            f"{summary.get('prompt_tokens_total', 0) / 1e6:.2f} M prompt tokens "
            f"(mean {summary.get('prompt_tokens_mean', 0):.0f}), normalize={summary.get('normalize')}"
            + (
                f", hit ceiling (infinite cache) {summary['ceiling_hit_rate']:.1%}"
                if "ceiling_hit_rate" in summary
                else ""
            )
        )
        for level, data in wl.get("levels", {}).items():
            parts.append(
                f"\n### {name} @ {level}: {_get(data, 'workload', 'requests') or '?'} requests offered at "
                f"{data.get('utilization', 0):.2f}x the fleet's prefill capacity (cache-blind), "
                f"{data.get('rate_rps', 0):.0f} req/s over {data.get('duration_s', 0):.1f} s "
                f"(time_scale {data.get('time_scale', '?')})"
            )
            parts.append(level_table(data))
            for policy, run in data.get("runs", {}).items():
                reasons = _get(run, "gateway", "reasons") or {}
                if len(reasons) > 1:
                    total = sum(reasons.values()) or 1
                    shares = ", ".join(
                        f"{k} {v / total:.0%}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])
                    )
                    parts.append(f"{policy} decisions: {shares}")
        verdicts = [Verdict(**v) for v in wl.get("targets", [])]
        if verdicts:
            parts.append(f"\nTargets ({name}):")
            parts.append(verdict_table(verdicts))
    parts.append("\n## Summary: the `prefix` row against the targets of issue 8")
    parts.append(summary_table(results))
    parts.append(
        "\nTTFT in wall-clock ms, client-side (first streamed content). '>' = includes requests still waiting at "
        "the deadline, counted at their wait so far. Ratios and 'vs pts' (hit-rate points against the peer) are "
        "medians over repetitions of each repetition's own ratio. 'work max/mean' = max/mean over replicas of "
        "uncached prompt tokens (prefill work) from the engines' counters: the balance target. 'in-flight "
        "max/mean' = time average of the per-replica in-flight max/mean (information); 'bound@assign' = share of "
        "requests whose replica, counting them, certainly held <= 1.25 x mean + 1 in flight when they were sent "
        "(information). 'router CPU ms/req' = the router process's CPU time over the run per request (on a shared "
        "machine the CPU a router needs decides how much its latency suffers from the neighbours). "
        "RR = round_robin (context)."
    )
    return "\n".join(parts)


# -- charts -----------------------------------------------------------------------------------


def _grid(results: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    workloads = list(results.get("workloads", {}))
    levels: list[str] = []
    for wl in results.get("workloads", {}).values():
        for level in wl.get("levels", {}):
            if level not in levels:
                levels.append(level)
    return workloads, levels


def _policy_colors(names: Sequence[str]) -> dict[str, Any]:
    import matplotlib

    palette = matplotlib.colormaps["tab10"]
    fixed = ["round_robin", "random", "least_loaded", "session", "prefix", PEER]
    order = fixed + [n for n in names if n not in fixed]
    return {n: palette(i % 10) for i, n in enumerate(order)}


def charts(results: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Write policies_hit_rate.png, policies_ttft.png and policies_load.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    out_dir.mkdir(parents=True, exist_ok=True)
    workloads, levels = _grid(results)
    if not workloads or not levels:
        return []
    all_policies: list[str] = []
    for wl in results["workloads"].values():
        for data in wl.get("levels", {}).values():
            for p in data.get("runs", {}):
                if p not in all_policies:
                    all_policies.append(p)
    colors = _policy_colors(all_policies)
    paths = []

    def panels(title: str, filename: str) -> Iterator[tuple[Any, Mapping[str, Any]]]:
        """One figure, a panel per workload x level: yields each panel with data, then saves the figure."""
        fig, axes = plt.subplots(
            len(workloads), len(levels), figsize=(max(6.5 * len(levels), 8.0), 3.4 * len(workloads)), squeeze=False
        )
        fig.suptitle(title, fontsize=13)
        for i, wname in enumerate(workloads):
            for j, level in enumerate(levels):
                ax = axes[i][j]
                data = results["workloads"][wname].get("levels", {}).get(level)
                ax.set_title(f"{wname} @ {level}", fontsize=10)
                if not data:
                    ax.axis("off")
                    continue
                yield ax, data
        fig.tight_layout()
        paths.append(out_dir / filename)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    # 1. hit rate per policy, with the pooled oracle and the target line
    for ax, data in panels("Prefix-cache hit rate (sum cached / sum prompt tokens)", "policies_hit_rate.png"):
        names = list(data.get("runs", {}))
        vals = [(data["runs"][n].get("hit_rate") or 0) * 100 for n in names]
        ax.bar(names, vals, color=[colors[n] for n in names])
        ohit = _get(data.get(ORACLE), "hit_rate")
        if ohit is not None:
            ax.axhline(ohit * 100, color="black", lw=1.2, label=f"pooled oracle {ohit:.0%}")
            ax.axhline(
                ohit * 100 * HIT_OF_ORACLE, color="black", lw=0.8, ls="--", label=f"{HIT_OF_ORACLE:.0%} of oracle"
            )
            ax.legend(fontsize=7, loc="upper left")
        for k, v in enumerate(vals):
            ax.text(k, v, f"{v:.0f}%", ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, max([*vals, (ohit or 0) * 100, 8]) * 1.25)
        ax.set_ylabel("hit rate %", fontsize=8)
        ax.tick_params(axis="x", labelsize=7, rotation=20)

    # 2. TTFT percentiles per policy (log scale)
    for ax, data in panels("Time to first token, client-side (wall ms, log scale)", "policies_ttft.png"):
        runs = dict(data.get("runs", {}))
        if data.get(ORACLE):
            runs["oracle"] = data[ORACLE]
        names = list(runs)
        width = 0.27
        for k, (q, alpha) in enumerate((("p50", 1.0), ("p90", 0.65), ("p99", 0.35))):
            xs = [x + (k - 1) * width for x in range(len(names))]
            vals = [max(_get(runs[n], "ttft_ms", q) or 0.0, 0.1) for n in names]
            ax.bar(
                xs,
                vals,
                width,
                alpha=alpha,
                label=q,
                color=[colors.get(n, (0.3, 0.3, 0.3, 1)) for n in names],
                edgecolor="black",
                linewidth=0.3,
            )
        ax.set_xticks(range(len(names)), names, fontsize=7, rotation=20)
        ax.set_yscale("log")
        ax.set_ylabel("ms", fontsize=8)
        shades = [Patch(facecolor="grey", alpha=a, edgecolor="black", lw=0.3) for a in (1.0, 0.65, 0.35)]
        ax.legend(shades, ["p50", "p90", "p99"], fontsize=7, loc="upper right", ncol=3)
        bottom, top = ax.get_ylim()
        ax.set_ylim(bottom, top * 2.2)  # headroom for the legend on the log scale

    # 3. per-replica load: time-averaged in-flight per replica, per policy
    load_title = "Per-replica load: time-averaged in-flight requests (under each policy: avg max/mean)"
    for ax, data in panels(load_title, "policies_load.png"):
        names = list(data.get("runs", {}))
        replicas: list[str] = []
        for n in names:
            for r in _get(data["runs"][n], "load", "replicas") or []:
                if r not in replicas:
                    replicas.append(r)
        width = 0.8 / max(len(replicas), 1)
        for k, rep in enumerate(replicas):
            xs = [x + (k - (len(replicas) - 1) / 2) * width for x in range(len(names))]
            vals = [(_get(data["runs"][n], "load", "mean_in_flight") or {}).get(rep, 0.0) for n in names]
            ax.bar(xs, vals, width, label=rep, color=plt.cm.Greys(0.35 + 0.5 * k / max(len(replicas), 1)))
        labels = [f"{n}\n{_fmt(_get(data['runs'][n], 'load', 'max_over_mean'), '.2f')}" for n in names]
        ax.set_xticks(range(len(names)), labels, fontsize=7)
        ax.set_ylabel("in-flight (avg)", fontsize=8)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.15)  # headroom for the legend
        ax.legend(fontsize=6, ncol=len(replicas), loc="upper left")
    return paths


def verdicts_to_json(verdicts: Sequence[Verdict]) -> list[dict[str, Any]]:
    return [asdict(v) for v in verdicts]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="re-render the policy benchmark report from its JSON")
    parser.add_argument("results", type=Path, help="benchmarks/results/bench_policies.json")
    parser.add_argument("--charts", type=Path, default=None, help="also write PNG charts into this folder")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    print(render_text(results))
    if args.charts:
        for path in charts(results, args.charts):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
