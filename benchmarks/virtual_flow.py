"""Flow control on the virtual clock: the ``prefix+flow`` row of ``bench_virtual.py`` and its verdict.

The row is the ``prefix`` row (the gateway's real pipeline, policy and runner) with the
gateway's flow-control core in front of it, as shipped (:mod:`gateway.flow`, default
settings): each arrival is classified (priority from the objective header, flow from the
fairness header, else the route), admitted (``admit``: at once while the route has room and
nothing is queued; shed if sheddable and saturated; else queued in the :class:`FlowQueue`),
and the :class:`Dispatcher` places queued requests — the policy's decision among the replicas
with room, at that moment (late binding) — whenever something may have freed room: an
arrival, a first token (the prefill is no longer queued), a finish, a TTL, a scrape.

Replica room is judged as in the gateway (:mod:`gateway.flow.saturation`) on the gateway's own
counts (in flight, queued prefill tokens: the runner's ``acquire`` / ``prefill_done``) and on
the engines' scraped numbers (waiting, running, KV usage), which the fleet scrapes every
``scrape.interval_s`` simulated seconds, so they lag as a real scrape does.

The verdict (:func:`verdict`): issue 26's targets over the samples (median of the seeds) per
workload and level: at saturation TTFT p90 <= 0.7x ``sglang_like``'s and <= 0.8x ``prefix``'s,
hit rate no more than 0.5 points under ``prefix``'s; at moderate load TTFT p50 and p90 within
5 % of ``prefix``'s, read as a cost (at most 1.05x: being faster is no failure).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from benchmarks.bench_prefix_path import pct
from benchmarks.bench_virtual import Arrival, GatewayRouter, ProjectedGatewayRouter, Routed
from gateway.config.schema import ScrapeSettings
from gateway.flow.classify import classify
from gateway.flow.dispatch import Dispatcher, admit, favourite
from gateway.flow.gate import ReplicaSignals
from gateway.flow.queue import Entry, FlowQueue, QueueFull
from gateway.flow.saturation import room, saturated
from gateway.flow.settings import FlowControlSettings
from gateway.replicas.engine import EngineStats

ROW = "prefix+flow"
SHIPPED_ROW = "shipped"  # the gateway as it ships: precise (projected) routing behind flow control


class FlowGatewayRouter(GatewayRouter):
    """The ``prefix`` route behind the gateway's flow control (a :class:`~benchmarks.bench_virtual.Gate`)."""

    scrape_interval = ScrapeSettings().interval_s

    def __init__(
        self,
        *args: Any,
        flow: FlowControlSettings | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        # the shipped settings, turned on (they ship off: this row measures what turning them on does)
        self.flow = flow or FlowControlSettings(enabled=True)
        self.limits = self.flow.saturation
        self.queue = FlowQueue(self.flow.band)
        self.dispatcher = Dispatcher(self.queue, self.flow.affinity_wait_s, self.flow.lookahead)
        self._out: list[tuple[int, Routed | None]] = []  # leaving at the next ready()
        self._wake: float | None = None
        self.now = 0.0
        self.arrived: dict[int, float] = {}  # queued request -> when it arrived
        self.waits: list[float] = []  # gateway wait of each queued request that was placed
        self.counts = {"direct": 0, "queued": 0, "shed": 0, "full": 0, "expired": 0}

    # -- the fleet's side (Gate) ------------------------------------------------------------
    def arrive(self, i: int, arrival: Arrival, now: float) -> None:
        _, req, body, headers = arrival
        self.now = now
        who = classify(self.flow, headers, self.route_.name)
        busy = self.flow.enabled and saturated([ReplicaSignals(r) for r in self.pool], self.limits, now)
        admission = admit(busy, len(self.queue), who.priority)
        if admission == "direct":
            self.counts["direct"] += 1
            self._out.append((i, self.route(req, body, headers)))
            return
        if admission == "shed":
            self.counts["shed"] += 1
            self._out.append((i, None))
            return
        view, _ = self._prepared[id(req)] = self._view(req, body, headers)
        cost = view.prompt_tokens_estimate or self.flow.fairness_quantum_tokens
        size = len(json.dumps(body, separators=(",", ":")))
        try:
            self.queue.push(who.flow, who.priority, cost, size, now, (i, req, body, headers))
        except QueueFull:
            self.counts["full"] += 1
            self._prepared.pop(id(req), None)
            self._out.append((i, None))
            return
        self.counts["queued"] += 1
        self.arrived[i] = now

    def ready(self, now: float) -> Iterator[tuple[int, Routed | None]]:
        self.now = now
        if len(self.queue):
            step = self.dispatcher.step(self, now)
            for _, (i, routed) in step.dispatched:
                self.waits.append(now - self.arrived.pop(i))
                self._out.append((i, routed))
            for entry in [*step.expired, *step.unplaceable]:
                self.counts["expired"] += 1
                self.arrived.pop(entry.item[0], None)
                self._prepared.pop(id(entry.item[1]), None)
                self._out.append((entry.item[0], None))
            self._wake = step.wake_at
        out, self._out = self._out, []
        return iter(out)

    def wake_at(self) -> float | None:
        return self._wake

    def scrape(self, engines: Sequence[Any], now: float) -> None:
        for replica, engine in zip(self.pool, engines, strict=True):
            replica.set_engine(
                EngineStats(
                    now,
                    kv_cache_usage=engine.cache.usage,
                    running=float(len(engine.running)),
                    waiting=float(len(engine.waiting)),
                    block_size=engine.block_size,
                    num_gpu_blocks=engine.options.num_gpu_blocks,
                )
            )

    # -- the dispatcher's side (gateway.flow.dispatch.Placer) --------------------------------
    def with_room(self, now: float) -> Collection[str]:
        full = room([ReplicaSignals(r) for r in self.pool], self.limits, now)
        return [r.name for r, why in zip(self.pool, full, strict=True) if why is None]

    def preferred(self, entry: Entry) -> str | None:
        _, req, body, headers = entry.item
        view, _ = self._view(req, body, headers)
        return favourite(self.route_.runner.decide(view, dry_run=True)[0])

    def place(self, entry: Entry, allowed: Collection[str]) -> tuple[int, Routed]:
        i, req, body, headers = entry.item
        return i, self.route(req, body, headers, exclude=[r.name for r in self.pool if r.name not in allowed])

    def figures(self) -> dict[str, Any]:
        """The queue's side of the run: how many waited, how long (simulated ms), what was refused."""
        return {**self.counts, "wait_p50_ms": 1000 * pct(self.waits, 0.5) if self.waits else 0.0,
                "wait_p90_ms": 1000 * pct(self.waits, 0.9) if self.waits else 0.0}  # fmt: skip


class ShippedGatewayRouter(FlowGatewayRouter, ProjectedGatewayRouter):
    """The gateway with every default on: KV events feed the precise index (projection on), the
    route tokenizes as the engine does, and flow control holds requests while the route is
    saturated. Its prediction is made when a request is placed, so what the engine holds when
    the request runs is nearer the gateway's view than when every request is placed on arrival."""


def parse_flow_variant(text: str) -> tuple[str, FlowControlSettings]:
    """``NAME:key=value,...`` -> a ``prefix+flow`` row named ``prefix+NAME`` with those settings
    (dotted keys reach into sections: ``saturation.queued_prefill_tokens=8192``)."""
    name, _, assignments = text.partition(":")
    data: dict[str, Any] = {}
    for item in filter(None, assignments.split(",")):
        key, _, value = item.partition("=")
        *path, leaf = key.strip().split(".")
        node = data
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = json.loads(value) if value.strip() not in ("",) else value
    return f"prefix+{name}", FlowControlSettings.model_validate({"enabled": True, **data})


# -- the verdict -----------------------------------------------------------------------------
SATURATED_VS_SGLANG = 0.7
SATURATED_VS_PREFIX = 0.8
HIT_POINTS = 0.5
MODERATE_BAND = 0.05


def verdict(per_seed: Sequence[dict[str, Any]], level: str) -> dict[str, Any]:
    """Issue 26's targets for one workload at one level, each on the median over samples."""

    def median(row: str, key: str) -> float:
        return statistics.median(cells[row][key] for cells in per_seed)

    flow = {k: median(ROW, k) for k in ("ttft_p50_ms", "ttft_p90_ms", "hit_rate")}
    base = {k: median("prefix", k) for k in ("ttft_p50_ms", "ttft_p90_ms", "hit_rate")}
    points = 100 * statistics.median(cells[ROW]["hit_rate"] - cells["prefix"]["hit_rate"] for cells in per_seed)
    checks: dict[str, dict[str, Any]] = {}
    if level == "saturated":
        ratio = flow["ttft_p90_ms"] / base["ttft_p90_ms"]
        checks["p90_vs_prefix"] = {"value": ratio, "target": f"<= {SATURATED_VS_PREFIX}"}
        checks["p90_vs_prefix"]["pass"] = ratio <= SATURATED_VS_PREFIX
        if all("sglang_like" in cells for cells in per_seed):
            ratio = flow["ttft_p90_ms"] / median("sglang_like", "ttft_p90_ms")
            checks["p90_vs_sglang_like"] = {"value": ratio, "target": f"<= {SATURATED_VS_SGLANG}",
                                            "pass": ratio <= SATURATED_VS_SGLANG}  # fmt: skip
        checks["hit_points_vs_prefix"] = {"value": points, "target": f">= -{HIT_POINTS}", "pass": points >= -HIT_POINTS}
    else:
        for key in ("ttft_p50_ms", "ttft_p90_ms"):
            ratio = flow[key] / base[key]
            # "within 5 %" read as a cost: flow control may not make it more than 5 % slower
            checks[f"{key[5:8]}_vs_prefix"] = {"value": ratio, "target": f"<= {1 + MODERATE_BAND:g}",
                                               "pass": ratio <= 1 + MODERATE_BAND}  # fmt: skip
    return {"medians": {ROW: flow, "prefix": base}, "checks": checks, "pass": all(c["pass"] for c in checks.values())}


def print_verdict(wname: str, level: str, result: dict[str, Any]) -> None:
    print(f"{wname} @ {level}: flow control vs off, median over samples")
    for name, c in result["checks"].items():
        print(f"  {name:<22} {c['value']:8.3f}  target {c['target']:<12} {'PASS' if c['pass'] else 'FAIL'}")


def _median(per_seed: Sequence[dict[str, Any]], row: str, key: str, scale: float = 1.0, fmt: str = ".0f") -> str:
    if not all(row in cells for cells in per_seed):
        return "-"
    return format(scale * statistics.median(cells[row][key] for cells in per_seed), fmt)


def verdict_table(results: dict[str, Any]) -> str:
    """A ``bench_virtual.py --flow`` result as a markdown table: per workload and level, the medians
    over samples of the rows the verdict reads, the ratios it judges, and PASS/FAIL."""
    lines = [
        "| workload @ level | hit % prefix / +flow / sglang | p50 ms prefix / +flow | p90 ms prefix / +flow / sglang "
        "| p90 x prefix | p90 x sglang | hit pts | p50 x prefix | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = ("prefix", ROW, "sglang_like")
    for wname, levels in results["workloads"].items():
        for level, cell in levels.items():
            per_seed = cell["seeds"]
            checks = verdict(per_seed, level)["checks"]
            hit = " / ".join(_median(per_seed, r, "hit_rate", 100, ".1f") for r in rows)
            p50 = " / ".join(_median(per_seed, r, "ttft_p50_ms") for r in rows[:2])
            p90 = " / ".join(_median(per_seed, r, "ttft_p90_ms") for r in rows)
            ratios = [
                f"{checks[name]['value']:.2f}" if name in checks else "-"
                for name in ("p90_vs_prefix", "p90_vs_sglang_like")
            ]
            points = 100 * statistics.median(c[ROW]["hit_rate"] - c["prefix"]["hit_rate"] for c in per_seed)
            p50_ratio = f"{checks['p50_vs_prefix']['value']:.2f}" if "p50_vs_prefix" in checks else "-"
            failed = [name for name, c in checks.items() if not c["pass"]]
            ruling = "PASS" if not failed else "FAIL: " + ", ".join(failed)
            lines.append(
                f"| {wname} @ {level} | {hit} | {p50} | {p90} | {' | '.join(ratios)} | {points:+.2f} "
                f"| {p50_ratio} | {ruling} |"
            )
    return "\n".join(lines)


def tenant_table(results: dict[str, Any]) -> str:
    """Per tenant TTFT p50/p90 (medians over samples) of ``prefix``, ``prefix+flow`` and ``sglang_like``."""
    lines = ["| workload @ level | tenant | p50 / p90 ms prefix | +flow | sglang_like |", "|---|---|---|---|---|"]
    for wname, levels in results["workloads"].items():
        for level, cell in levels.items():
            per_seed = cell["seeds"]
            if "tenants" not in per_seed[0]["prefix"]:
                continue
            for tenant in per_seed[0]["prefix"]["tenants"]:
                figures = []
                for row in ("prefix", ROW, "sglang_like"):
                    if not all(row in c for c in per_seed):
                        figures.append("-")
                        continue
                    p50, p90 = (
                        statistics.median(c[row]["tenants"][tenant][k] for c in per_seed)
                        for k in ("ttft_p50_ms", "ttft_p90_ms")
                    )
                    figures.append(f"{p50:.0f} / {p90:.0f}")
                lines.append(f"| {wname} @ {level} | {tenant} | " + " | ".join(figures) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python benchmarks/virtual_flow.py RESULT.json``: the verdict and tenant tables, in markdown."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("result", type=Path, help="a bench_virtual.json written with --flow")
    args = parser.parse_args(argv)
    results = json.loads(args.result.read_text())
    print(verdict_table(results))
    print()
    print(tenant_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
