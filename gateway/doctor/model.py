"""The data every doctor module shares: request samples, the corpus they form, findings, and
each route's summary of hit rates.

A :class:`Sample` is the same whether it came from the gateway's redacted sample buffer or
from a JSONL file: keys are opaque hashables (keyed fingerprints from the gateway, raw chain
keys from a file), ``body`` is set only when prompt text is available.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: roles whose text is meant to be the shared, stable part of a prompt
STABLE_ROLES = frozenset({"system", "developer", "tool_definition"})


@dataclass(frozen=True, slots=True)
class Part:
    """One message or tool definition: where it sits, its role, its length and a fingerprint."""

    where: str
    role: str
    chars: int
    fp: str


@dataclass(slots=True)
class Sample:
    """One request, as doctor sees it."""

    route: str
    endpoint: str
    model: str
    salt: str | None  # fingerprint of cache_salt (None: no salt)
    parts: list[Part]
    block_size: int
    keys: Sequence[Hashable] | None  # chain without the salt, as the route normalizes today
    prompt_tokens: int  # the whole prompt (reported by the replica when known)
    keys_relocated: Sequence[Hashable] | None = None  # chain with every detected span relocated
    tokens_relocated: int | None = None
    normalized: dict[str, int] = field(default_factory=dict)  # rule -> spans found / moved
    spans: list[tuple[str, str]] = field(default_factory=list)  # (where, rule) of each detected span
    cached_tokens: int | None = None  # reported by the replica
    reason: str | None = None  # the policy's routing reason
    body: dict[str, Any] | None = None  # prompt text: JSONL files, or samples.include_text

    @property
    def structure(self) -> tuple[tuple[str, str], ...]:
        """The template: which parts, in which roles (requests with the same one can be compared)."""
        return tuple((p.where, p.role) for p in self.parts)


@dataclass(slots=True)
class RouteInfo:
    """A route's keying, from the config (file) or ``/admin/samples`` (gateway)."""

    name: str
    normalize: str = "report"
    block_size: int = 16
    tokenizer: str = "cl100k_base"
    policy: str = "prefix"
    cache_blocks: int | None = None  # pooled engine KV capacity, when known


@dataclass(slots=True)
class Corpus:
    """Everything doctor knows: samples (oldest first), live stats, route settings, notes."""

    source: str
    samples: list[Sample] = field(default_factory=list)
    stats: dict[str, Any] | None = None
    routes: dict[str, RouteInfo] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what doctor could not see, for the report
    config: Any = None  # GatewayConfig when known (JSONL source): lets analyses replay new rules
    requests: int | None = None  # JSONL source: requests read (samples holds those that could be keyed)
    unrouted: dict[str, int] = field(default_factory=dict)  # JSONL source: model -> requests no route took

    def by_route(self) -> dict[str, list[Sample]]:
        out: dict[str, list[Sample]] = {}
        for sample in self.samples:
            out.setdefault(sample.route, []).append(sample)
        return out


@dataclass(slots=True)
class Fix:
    """The change that removes a cause: what to do, and the config snippet when a config change does it."""

    summary: str
    yaml: str | None = None
    patch: dict[str, Any] | None = None  # {"route": name, "normalize": {...}} etc., for tools and tests


@dataclass(slots=True)
class Finding:
    """One cause of misses on one route, with its evidence and fix."""

    cause: str  # volatile_span, learned_span, short_prompt, tenant_salt, user_first, tokenizer_mismatch, ...
    route: str
    title: str
    evidence: list[str]
    fix: Fix
    gain: float | None = None  # hit-rate points (0..1) this fix alone would add, by replay; None: not estimated
    gain_with_other_fixes: float | None = None  # the same once the other fixes are in place
    hit_rate_now: float | None = None  # replayed hit rate of the samples as they are
    hit_rate_if_fixed: float | None = None  # replayed hit rate with only this fix applied
    severity: float = 0.0  # ranking when no gain is known (0..1)
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> float:
        gains = [g for g in (self.gain, self.gain_with_other_fixes) if g is not None]
        return max([*gains, self.severity])

    def as_dict(self) -> dict[str, Any]:
        def r(value: float | None) -> float | None:
            return None if value is None else round(value, 4)

        return {
            "cause": self.cause,
            "route": self.route,
            "title": self.title,
            "gain": r(self.gain),
            "gain_with_other_fixes": r(self.gain_with_other_fixes),
            "hit_rate_now": r(self.hit_rate_now),
            "hit_rate_if_fixed": r(self.hit_rate_if_fixed),
            "severity": r(self.severity),
            "evidence": self.evidence,
            "fix": {"summary": self.fix.summary, "yaml": self.fix.yaml, "patch": self.fix.patch},
            "data": self.data,
        }


@dataclass(slots=True)
class RouteSummary:
    name: str
    normalize: str
    requests: int = 0
    hit_rate_reported: float | None = None  # stats (replicas' usage), else the samples' usage
    hit_rate_predicted: float | None = None  # the gateway's own prediction, from stats
    prediction_error: float | None = None  # mean |predicted - reported| per prompt token, from stats
    hit_rate_replayed: float | None = None  # the samples through a pooled LRU, as they are
    hit_rate_all_fixes: float | None = None  # the same with every replayable fix applied

    def as_dict(self) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 4)

        return {
            "name": self.name,
            "normalize": self.normalize,
            "requests": self.requests,
            "hit_rate_reported": r(self.hit_rate_reported),
            "hit_rate_predicted": r(self.hit_rate_predicted),
            "prediction_error": r(self.prediction_error),
            "hit_rate_replayed": r(self.hit_rate_replayed),
            "hit_rate_all_fixes": r(self.hit_rate_all_fixes),
        }
