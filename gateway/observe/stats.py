"""In-memory counters behind ``GET /admin/stats`` and the periodic summary line.

Prometheus counters are for scraping; these are for the gateway to read back cheaply:
cumulative per (route, replica), plus a per-route window that the summary line reads and
resets.  Hit rates divide cached tokens by the prompt tokens of the responses that
*reported* cached tokens, so a replica that omits the field reads as unknown, not as 0 %.
The predicted hit rate likewise divides the policy's predictions by the prompt tokens of
the answered requests that *had* a prediction (a retry on another replica has none).

Predictions are counted in the gateway's tokenizer, the replica's ``prompt_tokens`` in the
model's.  They agree when the route aligns with the served model (``tokenizer: auto`` on a
known family, or ``hf:DIR``, and the engines' block size); otherwise ``predicted_units`` says
``approximate (...): why`` (:mod:`gateway.prefix.exactness`) so the predicted hit rate is never
read as exact when it mixes units or blocks.
"""

from __future__ import annotations

from collections import Counter as _Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.observe.outcome import Outcome
from gateway.prefix.exactness import is_exact
from gateway.prefix.learn import suggest_pattern
from gateway.prefix.normalize import Normalizer

TTFT_SAMPLES = 4096  # per route and window: enough for p90 without unbounded memory


@dataclass(slots=True)
class Tally:
    requests: int = 0
    errors: int = 0  # status >= 400 or failed mid-stream
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_reported_prompt_tokens: int = 0
    cache_unreported_requests: int = 0
    predicted_cached_tokens: int = 0
    predicted_prompt_tokens: int = 0  # prompt tokens of the answered requests that had a prediction
    predicted_requests: int = 0
    predicted_units_seen: dict[str, int] = field(default_factory=dict)  # units label -> predictions
    # |predicted - reported| per request, by direction, over the requests that had both (and their
    # prompt tokens): over- and under-predictions do not cancel here, as they do in hit_rate_gap
    prediction_over_tokens: int = 0
    prediction_under_tokens: int = 0
    prediction_checked_prompt_tokens: int = 0

    def add(self, o: Outcome) -> None:
        self.requests += 1
        if o.status >= 400 or o.error_kind:
            self.errors += 1
        if o.prompt_tokens:
            self.prompt_tokens += o.prompt_tokens
            if o.cached_tokens is not None:
                self.cached_tokens += o.cached_tokens
                self.cache_reported_prompt_tokens += o.prompt_tokens
            else:
                self.cache_unreported_requests += 1
        if o.completion_tokens:
            self.completion_tokens += o.completion_tokens
        if o.predicted_cached_tokens is not None and o.prompt_tokens:
            self.predicted_cached_tokens += o.predicted_cached_tokens
            self.predicted_prompt_tokens += o.prompt_tokens
            self.predicted_requests += 1
            units = o.predicted_units or "approximate (unknown)"
            seen = self.predicted_units_seen
            if units in seen or len(seen) < 16:  # labels come from config and model families: few
                seen[units] = seen.get(units, 0) + 1
            miss = o.prediction_miss
            if miss is not None:
                if miss > 0:
                    self.prediction_over_tokens += miss
                else:
                    self.prediction_under_tokens -= miss
                self.prediction_checked_prompt_tokens += o.prompt_tokens

    @property
    def hit_rate_reported(self) -> float | None:
        d = self.cache_reported_prompt_tokens
        return self.cached_tokens / d if d else None

    @property
    def hit_rate_predicted(self) -> float | None:
        d = self.predicted_prompt_tokens
        return self.predicted_cached_tokens / d if d else None

    @property
    def prediction_error(self) -> float | None:
        """Mean |predicted - reported cached tokens| per prompt token (what issue 23's 0.5 % bar
        measures): 0 only when every prediction was exact."""
        d = self.prediction_checked_prompt_tokens
        return (self.prediction_over_tokens + self.prediction_under_tokens) / d if d else None

    @property
    def predicted_units(self) -> str | None:
        """One label when every prediction shared it, else ``mixed: a, b`` (approximate overall)."""
        seen = self.predicted_units_seen
        if not seen:
            return None
        if len(seen) == 1:
            return next(iter(seen))
        return "mixed: " + ", ".join(sorted(seen))

    @property
    def predicted_exact(self) -> bool | None:
        seen = self.predicted_units_seen
        return all(map(is_exact, seen)) if seen else None

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        del d["predicted_units_seen"]
        d["hit_rate_reported"] = _round(self.hit_rate_reported)
        d["hit_rate_predicted"] = _round(self.hit_rate_predicted)
        d["predicted_units"] = self.predicted_units
        d["predicted_exact"] = self.predicted_exact
        rep, pred = self.hit_rate_reported, self.hit_rate_predicted
        d["hit_rate_gap"] = None if rep is None or pred is None else round(pred - rep, 4)
        d["prediction_error"] = _round(self.prediction_error)
        return d


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


@dataclass(slots=True)
class Window:
    """One route's numbers since the last summary line."""

    tally: Tally = field(default_factory=Tally)
    ttft: list[float] = field(default_factory=list)
    reasons: _Counter[str] = field(default_factory=_Counter)


class StatsBook:
    def __init__(self) -> None:
        self.by_route_replica: dict[tuple[str, str], Tally] = {}
        self.by_route: dict[str, Tally] = {}
        self.reasons: dict[str, _Counter[str]] = {}
        self.windows: dict[str, Window] = {}

    def record(self, o: Outcome) -> None:
        route = o.route
        tally = self.by_route.get(route)
        if tally is None:
            tally = self.by_route[route] = Tally()
            self.reasons[route] = _Counter()
        tally.add(o)
        key = (route, o.replica or "none")
        pair = self.by_route_replica.get(key)
        if pair is None:
            pair = self.by_route_replica[key] = Tally()
        pair.add(o)
        window = self.windows.get(route)
        if window is None:
            window = self.windows[route] = Window()
        window.tally.add(o)
        if o.reason:
            self.reasons[route][o.reason] += 1
            window.reasons[o.reason] += 1
        if o.ttft_s is not None and len(window.ttft) < TTFT_SAMPLES:
            window.ttft.append(o.ttft_s)

    def take_window(self, route: str) -> Window:
        """The route's window so far; a fresh one starts."""
        return self.windows.pop(route, None) or Window()


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) or None for no data."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


# -- normalization (the `normalization` section of each route in /admin/stats) ---------------
STATS_PLACES = 20  # learned and static places listed per route (the most seen first)


def normalization_section(mode: str, normalizer: Normalizer | None) -> dict[str, Any]:
    """What normalization found, moved and kept on a route, and what it learned.

    ``rules``: per rule, spans found / moved / static (kept: never seen changing) / protected
    (kept: inside code or JSON).  ``learned``: places whose value was seen to change (moved),
    each with where it sits (field + digest of the surrounding text), an example *shape*
    (raw text only with ``normalize.learn.examples: raw``) and a regex rule that would pin it.
    Spans discovered by comparing successive requests (no detector knows them) are listed
    with rule ``learned``.  ``static``: places that never changed.  ``warmup_misses``: requests that kept a value in
    place before its place was known to vary.  No prompt text by default.
    """
    section: dict[str, Any] = {
        "mode": mode,
        "active": normalizer is not None and mode != "off",
        "rules": {},
        "learned": [],
        "static": [],
        "warmup_misses": 0,
    }
    if normalizer is None:
        return section
    section["rules"] = {
        rule: {"found": row[0], "moved": row[1], "static": row[2], "protected": row[3]}
        for rule, row in sorted(normalizer.tally.items())
    }
    places = sorted(normalizer.learner.places(), key=lambda p: -p.seen)
    learned = [p for p in places if p.varies][:STATS_PLACES]
    static = [p for p in places if not p.varies and p.seen > 1][:STATS_PLACES]
    discovered = normalizer.discoverer.rules() if normalizer.discoverer is not None else []
    section["learned"] = (
        [
            {
                "rule": "learned",  # discovered by comparing successive requests: no detector knows it
                "where": f"{d.where} ctx={d.context}",
                "example": d.example,
                "suggested_rule": {"name": _rule_name("learned", d.context), "pattern": d.pattern},
                "seen": d.seen,
                "changes": d.changes,
            }
            for d in sorted(discovered, key=lambda d: -d.seen)[:STATS_PLACES]
        ]
        + [
            {
                "rule": p.rule,
                "where": f"{p.where} ctx={p.context}",
                "example": p.example,
                "suggested_rule": {"name": _rule_name(p.rule, p.context), "pattern": suggest_pattern(p.example)},
                "seen": p.seen,
                "changes": p.changes,
            }
            for p in learned
        ]
    )
    section["static"] = [
        {"rule": p.rule, "where": f"{p.where} ctx={p.context}", "example": p.example, "seen": p.seen} for p in static
    ]
    section["warmup_misses"] = normalizer.learner.warmup_misses + (
        normalizer.discoverer.warmup_misses if normalizer.discoverer is not None else 0
    )
    return section


def _rule_name(rule: str, context: str) -> str:
    """A config rule name for a learned place: unique per place, never a detector's name."""
    return f"pin_{rule[:18]}_{context[:6]}"
