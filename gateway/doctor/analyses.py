"""Run every analysis of a low prefix-cache hit rate over every route: :func:`diagnose`.

Every analysis reads a :class:`~gateway.doctor.model.Corpus` and returns findings with the
evidence it saw and the change that fixes the cause.  Gains are estimated by replaying the
samples' key chains through an LRU cache of blocks (:mod:`.replay`) with and without the
fix — the chains come from the gateway's own pipeline, so a prediction is what the fixed
gateway would compute.  Causes that need live numbers (tokenizer misalignment, KV pressure,
spills) read ``/admin/stats`` and carry a severity instead of a replayed gain.  The two
families are :mod:`.replayed` and :mod:`.live_stats`; this module runs them and ranks what
they find.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.doctor.discovery import discovery_failing
from gateway.doctor.evidence import reported_rate
from gateway.doctor.kv_modes import kv_fallbacks, kv_mode_notes
from gateway.doctor.live_stats import (
    imbalance_spills,
    kv_pressure,
    learned_by_gateway,
    saturated_route,
    scrape_failing,
    tokenizer_misalignment,
    volatile_from_stats,
    warmup_misses,
)
from gateway.doctor.model import Corpus, Finding, RouteInfo, RouteSummary
from gateway.doctor.replayed import RouteReplay

__all__ = ["Diagnosis", "RouteSummary", "diagnose"]


@dataclass(slots=True)
class Diagnosis:
    source: str
    routes: list[RouteSummary] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def diagnose(corpus: Corpus) -> Diagnosis:
    """Every analysis over every route, findings ranked by what fixing them gains."""
    out = Diagnosis(source=corpus.source, notes=[*corpus.notes, *kv_mode_notes(corpus.stats)])
    by_route = corpus.by_route()
    stats_routes = (corpus.stats or {}).get("routes") or {}
    names = list(dict.fromkeys([*corpus.routes, *by_route, *stats_routes]))
    for name in names:
        info = corpus.routes.get(name) or RouteInfo(name)
        samples = by_route.get(name, [])
        summary = RouteSummary(name, info.normalize, requests=len(samples))
        live = stats_routes.get(name) or {}
        summary.hit_rate_reported = live.get("hit_rate_reported", reported_rate(samples))
        summary.hit_rate_predicted = live.get("hit_rate_predicted")
        summary.prediction_error = live.get("prediction_error")
        if live.get("requests") is not None:
            summary.requests = max(summary.requests, int(live["requests"]))
        findings: list[Finding] = []
        if samples:
            findings += RouteReplay(corpus, info, samples).analyse(summary)
        findings += tokenizer_misalignment(corpus, info, live)
        findings += kv_pressure(corpus, info, live, samples)
        findings += imbalance_spills(info, live)
        findings += saturated_route(info, live)
        findings += scrape_failing(corpus, info, live)
        findings += learned_by_gateway(info, live, samples)
        if not samples:
            findings += volatile_from_stats(info, live)
        findings += warmup_misses(info, live)
        findings += kv_fallbacks(name, live, corpus.stats)
        out.routes.append(summary)
        out.findings += findings
    out.findings += discovery_failing(corpus.stats)
    out.findings.sort(key=lambda f: f.rank, reverse=True)
    return out
