"""One analysis per cause of a low prefix-cache hit rate; :func:`diagnose` runs them all.

Every analysis reads a :class:`~gateway.doctor.model.Corpus` and returns findings with the
evidence it saw and the change that fixes the cause.  Gains are estimated by replaying the
samples' key chains through an LRU cache of blocks (:mod:`.replay`) with and without the
fix — the chains come from the gateway's own pipeline, so a prediction is what the fixed
gateway would compute.  Causes that need live numbers (tokenizer misalignment, KV pressure,
spills) read ``/admin/stats`` and carry a severity instead of a replayed gain.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from gateway.doctor.model import STABLE_ROLES, Corpus, Finding, Fix, RouteInfo, Sample
from gateway.doctor.rekey import Rekeyer, relocating
from gateway.doctor.replay import Request, replay
from gateway.doctor.spans import LearnedSpan, find_spans
from gateway.observe.samples import body_parts
from gateway.prefix.settings import NormalizeSettings, PrefixSettings

KV_PRESSURE = 0.90  # engine KV usage at or above this is "near full"
MISALIGNED_GAP = 0.10  # predicted minus reported hit rate that points at tokenization
SPILL_SHARE = 0.10  # share of routing decisions that left the cached replica
MIN_REQUESTS = 10  # live-rate findings need at least this many requests behind them
CHARS_PER_TOKEN = 4  # estimate for text doctor can only measure in characters


@dataclass(slots=True)
class RouteSummary:
    name: str
    normalize: str
    requests: int = 0
    hit_rate_reported: float | None = None  # stats (replicas' usage), else the samples' usage
    hit_rate_predicted: float | None = None  # the gateway's own prediction, from stats
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
            "hit_rate_replayed": r(self.hit_rate_replayed),
            "hit_rate_all_fixes": r(self.hit_rate_all_fixes),
        }


@dataclass(slots=True)
class Diagnosis:
    source: str
    routes: list[RouteSummary] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def diagnose(corpus: Corpus) -> Diagnosis:
    """Every analysis over every route, findings ranked by what fixing them gains."""
    out = Diagnosis(source=corpus.source, notes=list(corpus.notes))
    by_route = corpus.by_route()
    stats_routes = (corpus.stats or {}).get("routes") or {}
    names = list(dict.fromkeys([*corpus.routes, *by_route, *stats_routes]))
    for name in names:
        info = corpus.routes.get(name) or RouteInfo(name)
        samples = by_route.get(name, [])
        summary = RouteSummary(name, info.normalize, requests=len(samples))
        live = stats_routes.get(name) or {}
        summary.hit_rate_reported = live.get("hit_rate_reported", _reported(samples))
        summary.hit_rate_predicted = live.get("hit_rate_predicted")
        if live.get("requests") is not None:
            summary.requests = max(summary.requests, int(live["requests"]))
        findings: list[Finding] = []
        if samples:
            findings += RouteReplay(corpus, info, samples).analyse(summary)
        findings += tokenizer_misalignment(corpus, info, live)
        findings += kv_pressure(corpus, info, live, samples)
        findings += imbalance_spills(info, live)
        findings += learned_by_gateway(info, live, samples)
        if not samples:
            findings += volatile_from_stats(info, live)
        findings += warmup_misses(info, live)
        out.routes.append(summary)
        out.findings += findings
    out.findings.sort(key=lambda f: f.rank, reverse=True)
    return out


def _reported(samples: Sequence[Sample]) -> float | None:
    known = [s for s in samples if s.cached_tokens is not None and s.prompt_tokens]
    prompt = sum(s.prompt_tokens for s in known)
    return sum(s.cached_tokens or 0 for s in known) / prompt if prompt else None


def _route_yaml(route: str, section: dict[str, Any]) -> str:
    return yaml.safe_dump({"routes": [{"name": route, **section}]}, sort_keys=False, allow_unicode=True).rstrip()


def _pct(value: float) -> str:
    return f"{value * 100:.1f} %"


# -- the replayable causes -----------------------------------------------------------------
Fixer = Callable[[Sample], Request]


class RouteReplay:
    """One route's samples and the fixes that can be replayed on them."""

    def __init__(self, corpus: Corpus, info: RouteInfo, samples: list[Sample]) -> None:
        self.corpus = corpus
        self.info = info
        self.samples = samples
        self.with_text = all(s.body is not None for s in samples)
        self.fixes: dict[str, Callable[[Sample, Request], Request]] = {}
        self._rule_keys: dict[int, tuple[Sequence[Any], int]] = {}

    # replay helpers
    def rate(self, applied: Sequence[str] = ()) -> float:
        def request(sample: Sample) -> Request:
            req = Request(sample.salt, sample.keys or (), sample.prompt_tokens, sample.block_size)
            for name in applied:
                req = self.fixes[name](sample, req)
            return req

        return replay(map(request, self.samples), self.info.cache_blocks).rate

    def leave_one_out(self, name: str) -> float:
        every = list(self.fixes)
        return self.rate(every) - self.rate([f for f in every if f != name])

    def analyse(self, summary: RouteSummary) -> list[Finding]:
        found: list[tuple[str, Finding]] = []
        for fixer, finding in (self.volatile(), self.unknown_spans(), self.salts()):
            if finding is not None:
                found.append((fixer, finding))
        now = self.rate()
        summary.hit_rate_replayed = now
        summary.hit_rate_all_fixes = self.rate(list(self.fixes)) if self.fixes else now
        for fixer, finding in found:
            finding.hit_rate_now = now
            finding.hit_rate_if_fixed = self.rate([fixer])
            finding.gain = finding.hit_rate_if_fixed - now
            if fixer == "relocate" and "rules" in self.fixes:
                finding.evidence.append("the suggested rules (learned_span) relocate too: that fix includes this one")
            else:
                finding.gain_with_other_fixes = self.leave_one_out(fixer)
        out = [finding for _, finding in found]
        out += self.short_prompts()
        out += self.user_first()
        if not any(f.cause in ("volatile_span", "learned_span") for f in out):
            out += self.varying_without_rule()
        return out

    # volatile spans the route's detectors and rules find
    def volatile(self) -> tuple[str, Finding | None]:
        if self.info.normalize == "relocate":
            return "relocate", None
        counts: Counter[str] = Counter()
        requests_with = 0
        for s in self.samples:
            # mode off counts nothing: the shadow pipeline's spans say what relocation would move
            found = s.normalized or Counter(rule for _, rule in s.spans)
            counts.update(found)
            requests_with += bool(found)
        if not counts or not any(s.keys_relocated is not None for s in self.samples):
            return "relocate", None

        def relocated(sample: Sample, req: Request) -> Request:
            if sample.keys_relocated is None:
                return req
            return Request(
                req.namespace, sample.keys_relocated, sample.tokens_relocated or req.prompt_tokens, req.block_size
            )

        self.fixes["relocate"] = relocated
        rules = ", ".join(f"{rule} x{n}" for rule, n in counts.most_common())
        places = Counter(span for s in self.samples for span in s.spans)
        evidence = [
            f"{requests_with} of {len(self.samples)} requests have volatile values in their stable prefix ({rules})",
            *(f"{rule} in {where}: {n} requests" for (where, rule), n in places.most_common()),
            f"the route's normalize mode is {self.info.normalize!r}: they stay in place and split the cache",
            *self.varying_parts(),
        ]
        fix = Fix(
            summary="relocate them: each value is replaced by a stable placeholder and moved after the stable "
            "prefix (the model still receives every value)",
            yaml=_route_yaml(self.info.name, {"normalize": {"mode": "relocate"}}),
            patch={"route": self.info.name, "normalize": {"mode": "relocate"}},
        )
        finding = Finding(
            "volatile_span",
            self.info.name,
            f"volatile values in the stable prefix ({', '.join(counts)}) are not relocated",
            evidence,
            fix,
            data={
                "rules": dict(counts),
                "requests": requests_with,
                "spans": [{"where": w, "rule": r, "requests": n} for (w, r), n in places.most_common()],
            },
        )
        return "relocate", finding

    # volatile spans no rule knows (needs prompt text)
    def unknown_spans(self) -> tuple[str, Finding | None]:
        if not self.with_text:
            return "rules", None
        normalize, prefix = self._settings()
        base = Rekeyer(relocating(normalize, eager=True), prefix)
        texts: dict[str, list[str]] = {}
        for s in self.samples:
            moved = base.prepare(s.endpoint, s.body or {}).body
            for where, role, text in body_parts(s.endpoint, moved):
                if role in STABLE_ROLES or role == "prompt":
                    texts.setdefault(where, []).append(text)
        spans = find_spans(texts)
        if not spans:
            return "rules", None
        rules = [{"name": span.name, "pattern": span.pattern} for span in spans]
        rekey = Rekeyer(relocating(normalize, rules), prefix)
        chains = {}
        for s in self.samples:
            prepared = rekey.prepare(s.endpoint, s.body or {})
            chains[id(s)] = (prepared.block_keys, prepared.prompt_tokens_estimate)

        def with_rules(sample: Sample, req: Request) -> Request:
            keys, tokens = chains[id(sample)]
            return Request(req.namespace, keys, tokens, req.block_size)

        self.fixes["rules"] = with_rules
        section = {"normalize": {"mode": "relocate", "rules": [*(r.model_dump() for r in normalize.rules), *rules]}}
        section["normalize"]["rules"] = [
            {"name": r["name"], "pattern": r["pattern"]} for r in section["normalize"]["rules"]
        ]
        evidence = [_span_line(span) for span in spans]
        finding = Finding(
            "learned_span",
            self.info.name,
            f"{len(spans)} volatile span(s) that no rule knows change between requests of the same template",
            evidence,
            Fix(
                summary="pin them with regex rules (the patterns match every value seen) and relocate",
                yaml=_route_yaml(self.info.name, section),
                patch={"route": self.info.name, **section},
            ),
            data={"spans": [_span_data(span) for span in spans]},
        )
        return "rules", finding

    def _settings(self) -> tuple[NormalizeSettings, PrefixSettings]:
        config = self.corpus.config
        if config is not None:
            for route in config.routes:
                if route.name == self.info.name:
                    return route.normalize, route.prefix
        return (
            NormalizeSettings(mode=self.info.normalize),  # type: ignore[arg-type]
            PrefixSettings(block_size=self.info.block_size, tokenizer=self.info.tokenizer),
        )

    # per-tenant salts
    def salts(self) -> tuple[str, Finding | None]:
        salts = {s.salt for s in self.samples}
        if len(salts) < 2:
            return "salts", None
        firsts: dict[Any, set[Any]] = {}
        for s in self.samples:
            keys = s.keys_relocated if s.keys_relocated is not None else s.keys
            if keys:
                firsts.setdefault(keys[0], set()).add(s.salt)
        shared = [k for k, where in firsts.items() if len(where) > 1]
        if not shared:
            return "salts", None
        splitting = set().union(*(firsts[k] for k in shared))
        self.fixes["salts"] = lambda sample, req: Request(None, req.keys, req.prompt_tokens, req.block_size)
        per_salt = Counter("(no salt)" if s.salt is None else s.salt for s in self.samples if s.salt in splitting)
        evidence = [
            f"{len(splitting)} cache_salt namespaces over {sum(per_salt.values())} requests "
            f"(requests per salt fingerprint: {dict(per_salt.most_common(6))})",
            f"{len(shared)} prompt start(s) are sent under more than one salt: each salt computes and "
            "caches the same prefix again",
        ]
        finding = Finding(
            "tenant_salt",
            self.info.name,
            f"per-tenant cache_salt values split the cache {len(splitting)} ways for the same prompts",
            evidence,
            Fix(
                summary="cache_salt is set by the clients to isolate tenants from each other's cache (no gateway "
                "setting changes it): where tenants may share cached prompts, send one salt per trust group, "
                "or none; keep salts where isolation is required",
            ),
            data={"salts": len(splitting), "shared_prefixes": len(shared)},
        )
        return "salts", finding

    # prompts no block can hold
    def short_prompts(self) -> list[Finding]:
        short = [s for s in self.samples if s.prompt_tokens <= s.block_size]
        if not short:
            return []
        total = sum(s.prompt_tokens for s in self.samples) or 1
        tokens = sum(s.prompt_tokens for s in short)
        bs = self.samples[0].block_size
        share = len(short) / len(self.samples)
        return [
            Finding(
                "short_prompt",
                self.info.name,
                f"{len(short)} of {len(self.samples)} requests ({_pct(share)}) are shorter than one "
                f"{bs}-token block: they can never be served from cache",
                [
                    f"prompt lengths {min(s.prompt_tokens for s in short)}..{max(s.prompt_tokens for s in short)} "
                    f"tokens; vLLM caches whole blocks of {bs} tokens and always computes the last token",
                    f"they are {_pct(tokens / total)} of the prompt tokens: per-request hit rates drop, "
                    "the token-weighted hit rate barely moves",
                ],
                Fix(
                    summary="nothing to change in the gateway (the prefix policy already sends them to the least "
                    "loaded replica); leave them out when judging per-request hit rates, or give such calls the "
                    "shared system prompt the other requests use so they can hit"
                ),
                severity=min(0.5, share / 2),
                data={"requests": len(short), "share": round(share, 4), "token_share": round(tokens / total, 4)},
            )
        ]

    # a per-request part before a long shared part
    def user_first(self) -> list[Finding]:
        groups: dict[tuple[tuple[str, str], ...], list[Sample]] = {}
        for s in self.samples:
            groups.setdefault(s.structure, []).append(s)
        out = []
        total = sum(s.prompt_tokens for s in self.samples) or 1
        for structure, members in groups.items():
            if len(members) < 3:
                continue
            varies = [len({m.parts[i].fp for m in members}) for i in range(len(structure))]
            for i, (where_i, role_i) in enumerate(structure):
                if role_i != "user" or varies[i] < max(2, len(members) // 2):
                    continue
                later = [
                    j
                    for j in range(i + 1, len(structure))
                    if varies[j] == 1 and members[0].parts[j].chars >= CHARS_PER_TOKEN * 4 * self.info.block_size
                ]
                if not later:
                    continue
                j = max(later, key=lambda k: members[0].parts[k].chars)
                chars = members[0].parts[j].chars
                bs = self.info.block_size
                tokens = chars // CHARS_PER_TOKEN // bs * bs
                gain = tokens * (len(members) - 1) / total
                out.append(
                    Finding(
                        "user_first",
                        self.info.name,
                        f"per-request input ({where_i}, {role_i}) comes before a shared {chars}-character "
                        f"{structure[j][1]} part ({structure[j][0]})",
                        [
                            f"in {len(members)} requests of this template {where_i} differs {varies[i]} ways while "
                            f"{structure[j][0]} is identical every time",
                            "the cache matches prefixes only: everything after the first difference is recomputed, "
                            f"about {tokens} tokens of shared text per request",
                        ],
                        Fix(
                            summary=f"put the shared {structure[j][1]} text first and the per-request "
                            f"{role_i} text after it (client side: the order of messages or prompt parts)"
                        ),
                        gain=gain,
                        severity=gain,
                        data={"where": where_i, "shared": structure[j][0], "estimated_tokens": tokens},
                    )
                )
                break
        return out

    # parts meant to be stable that change anyway, when no rule explains it
    def varying_parts(self) -> list[str]:
        lines = []
        counts: dict[str, list[Any]] = {}
        for s in self.samples:
            for p in s.parts:
                if p.role in STABLE_ROLES:
                    counts.setdefault(p.where, []).append(p)
        for where, parts in counts.items():
            distinct = len({p.fp for p in parts})
            if distinct < 2 or len(parts) < 3:
                continue
            lengths = [p.chars for p in parts]
            lines.append(
                f"{where} ({parts[0].role}, ~{sum(lengths) // len(lengths)} chars) has {distinct} different "
                f"texts in {len(parts)} requests, lengths {min(lengths)}..{max(lengths)}"
            )
        return lines

    def varying_without_rule(self) -> list[Finding]:
        lines = self.varying_parts()
        if not lines:
            return []
        tip = (
            "no rule matched and the diff found no short span: the part may be rewritten per request"
            if self.with_text
            else "no rule matched: run `prefix-gateway doctor --file` on a JSONL sample of the requests, or turn on "
            "samples.include_text (debug) briefly, so doctor can diff the texts and suggest a rule"
        )
        return [
            Finding(
                "volatile_span",
                self.info.name,
                "stable parts (system/developer messages, tool definitions) change between requests",
                [*lines, tip],
                Fix(summary=tip),
                severity=0.5,
            )
        ]


def _span_line(span: LearnedSpan) -> str:
    return (
        f"{span.where}: after {span.left[-16:]!r}, a value shaped like {span.example_shape!r} changed in "
        f"{span.changes} successive pairs → rule {span.name}: {span.pattern}"
    )


def _span_data(span: LearnedSpan) -> dict[str, Any]:
    return {
        "where": span.where,
        "left": span.left,
        "example": span.example_shape,
        "changes": span.changes,
        "suggested_rule": {"name": span.name, "pattern": span.pattern},
    }


# -- causes read from live stats ---------------------------------------------------------------
def learned_by_gateway(info: RouteInfo, live: dict[str, Any], samples: Sequence[Sample]) -> list[Finding]:
    """Spans the gateway itself learned (``normalization.learned`` in /admin/stats), with their rules."""
    from gateway.prefix.settings import DETECTORS

    learned = _normalization(live).get("learned")
    if not isinstance(learned, list) or not learned:
        return []
    out = []
    rules = []
    lines = []
    for entry in learned:
        if not isinstance(entry, dict) or entry.get("rule") in DETECTORS:
            continue  # a detector's place seen to vary is known already (its cost shows as warmup_miss)
        rule = entry.get("suggested_rule")
        if isinstance(rule, dict) and rule.get("name") and rule.get("pattern"):
            rules.append({"name": str(rule["name"]), "pattern": str(rule["pattern"])})
        lines.append(
            f"{entry.get('where', '?')}: a value shaped like {entry.get('example', '?')!r} changed "
            f"{entry.get('changes', '?')} times in {entry.get('seen', '?')} requests"
            + (f" → rule {rule.get('name')}: {rule.get('pattern')}" if isinstance(rule, dict) else "")
        )
    if not lines:
        return []
    section = {"normalize": {"mode": "relocate", "rules": rules}}
    relocating_now = info.normalize == "relocate"
    out.append(
        Finding(
            "learned_span",
            info.name,
            f"the gateway learned {len(lines)} volatile span(s) no rule knows"
            + (" (relocated while learned; pin them to keep them after a restart)" if relocating_now else ""),
            lines,
            Fix(
                summary="pin the learned spans as rules so they are relocated from the first request, "
                "also after a restart",
                yaml=_route_yaml(info.name, section) if rules else None,
                patch={"route": info.name, **section} if rules else None,
            ),
            severity=0.2 if relocating_now else 0.6,
        )
    )
    return out


def _normalization(live: dict[str, Any]) -> dict[str, Any]:
    norm = live.get("normalization")
    return norm if isinstance(norm, dict) else {}


def _rule_rows(live: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rules = _normalization(live).get("rules")
    return {k: v for k, v in rules.items() if isinstance(v, dict)} if isinstance(rules, dict) else {}


def volatile_from_stats(info: RouteInfo, live: dict[str, Any]) -> list[Finding]:
    """Without samples: the route's own counts of spans found but left in place (report/off mode)."""
    if info.normalize == "relocate":
        return []
    found = {rule: row.get("found") for rule, row in _rule_rows(live).items()}
    found = {rule: n for rule, n in found.items() if isinstance(n, int) and n > 0}
    if not found:
        return []
    patch = {"route": info.name, "normalize": {"mode": "relocate"}}
    return [
        Finding(
            "volatile_span",
            info.name,
            f"volatile values in the stable prefix ({', '.join(found)}) are not relocated",
            [
                "spans found by the route's detectors since start: "
                + ", ".join(f"{rule} x{n}" for rule, n in sorted(found.items(), key=lambda kv: -kv[1])),
                f"the route's normalize mode is {info.normalize!r}: they stay in place and split the cache",
                "turn on the sample buffer (samples.enabled) to estimate what relocating gains",
            ],
            Fix(
                summary="relocate them after the stable prefix (the model still receives every value)",
                yaml=_route_yaml(info.name, {"normalize": {"mode": "relocate"}}),
                patch=patch,
            ),
            severity=0.8,
            data={"rules": found},
        )
    ]


def warmup_misses(info: RouteInfo, live: dict[str, Any]) -> list[Finding]:
    """Requests that kept a value in place while the gateway was still learning that it varies."""
    if info.normalize != "relocate":
        return []  # nothing is moved in report or off mode: every volatile value costs, not only the first
    misses = _normalization(live).get("warmup_misses")
    requests = live.get("requests") or 0
    if not isinstance(misses, int) or misses <= 0 or not requests or misses / requests < 0.02:
        return []
    from gateway.prefix.settings import DETECTORS

    moved = [rule for rule, row in _rule_rows(live).items() if rule in DETECTORS and (row.get("moved") or 0) > 0]
    section = {"normalize": {"always": moved}} if moved else None
    share = misses / requests
    return [
        Finding(
            "warmup_miss",
            info.name,
            f"{misses} requests ({_pct(share)}) kept a volatile value in place while the gateway learned that it "
            "varies",
            [
                "a detected span is moved only once its value was seen to change at the same place; each new "
                "template (and each place forgotten after normalize.learn.expire_s) costs a miss or two",
                *(
                    f"{rule}: moved {row.get('moved')} of {row.get('found')} found"
                    for rule, row in _rule_rows(live).items()
                ),
            ],
            Fix(
                summary="move the detectors that always vary from the first request on (normalize.always), or "
                "keep places longer (normalize.learn.expire_s) when templates come back after long pauses",
                yaml=_route_yaml(info.name, section) if section else None,
                patch={"route": info.name, **section} if section else None,
            ),
            severity=min(0.5, share),
            data={"warmup_misses": misses, "share": round(share, 4)},
        )
    ]


def _engines(corpus: Corpus, live: dict[str, Any]) -> dict[str, dict[str, Any]]:
    replicas = (corpus.stats or {}).get("replicas") or {}
    out = {}
    for name in live.get("replicas") or {}:
        engine = (replicas.get(name) or {}).get("engine")
        if isinstance(engine, dict):
            out[name] = engine
    return out


def tokenizer_misalignment(corpus: Corpus, info: RouteInfo, live: dict[str, Any]) -> list[Finding]:
    predicted, reported = live.get("hit_rate_predicted"), live.get("hit_rate_reported")
    evidence = []
    block_sizes = {e.get("block_size") for e in _engines(corpus, live).values()} - {None}
    wrong_block = sorted(b for b in block_sizes if b != info.block_size)
    if wrong_block:
        evidence.append(f"the engines use block size {wrong_block}, the route hashes {info.block_size}-token blocks")
    gap = None
    if (
        isinstance(predicted, int | float)
        and isinstance(reported, int | float)
        and (live.get("predicted_requests") or 0) >= MIN_REQUESTS
    ):
        gap = predicted - reported
        if gap >= MISALIGNED_GAP:
            evidence.append(
                f"the gateway predicted {_pct(predicted)} cached, the replicas reported {_pct(reported)} "
                f"over {live.get('predicted_requests')} requests: the gateway's tokens or blocks do not line up "
                "with the engines' (or the engines evict: see KV pressure)"
            )
            units = live.get("predicted_units")
            if live.get("predicted_exact") is False and isinstance(units, str):
                evidence.append(f"the predictions are counted in {units} tokens, not the served model's")
    if not evidence:
        return []
    prefix = {
        "tokenizer": "hf:/path/to/the/model_dir",
        "block_size": wrong_block[0] if wrong_block else info.block_size,
    }
    return [
        Finding(
            "tokenizer_mismatch",
            info.name,
            "the gateway's tokenizer or block size does not match the engines'",
            evidence,
            Fix(
                summary=f"hash with the served model's own tokenizer and chat template (now {info.tokenizer}; "
                "`auto` knows Llama 3.x and Qwen2.5/3 by name, `hf:DIR` reads any local model) and the engines' "
                "--block-size, so predicted blocks are the engines' blocks",
                yaml=_route_yaml(info.name, {"prefix": prefix}),
                patch={"route": info.name, "prefix": prefix},
            ),
            severity=max(gap or 0.0, 0.5 if wrong_block else 0.0),
            data={"gap": None if gap is None else round(gap, 4), "engine_block_sizes": sorted(block_sizes)},
        )
    ]


def kv_pressure(corpus: Corpus, info: RouteInfo, live: dict[str, Any], samples: Sequence[Sample]) -> list[Finding]:
    engines = _engines(corpus, live)
    full = {
        name: e["kv_cache_usage"]
        for name, e in engines.items()
        if isinstance(e.get("kv_cache_usage"), int | float) and e["kv_cache_usage"] >= KV_PRESSURE
    }
    if not full:
        return []
    evidence = [
        "KV cache usage near full on " + ", ".join(f"{name} {_pct(usage)}" for name, usage in sorted(full.items()))
    ]
    falling = False
    known = [s for s in samples if s.cached_tokens is not None and s.prompt_tokens]
    if len(known) >= 2 * MIN_REQUESTS:
        half = len(known) // 2
        first, second = _reported(known[:half]), _reported(known[half:])
        if first is not None and second is not None:
            evidence.append(
                f"reported hit rate {_pct(first)} in the older half of the samples, {_pct(second)} in the newer"
            )
            falling = second < first - 0.05
    predicted, reported = live.get("hit_rate_predicted"), live.get("hit_rate_reported")
    if isinstance(predicted, int | float) and isinstance(reported, int | float) and predicted > reported:
        evidence.append(
            f"predicted {_pct(predicted)} vs reported {_pct(reported)}: cached prefixes are evicted before reuse"
        )
    # The engines publish their cache size (vllm:cache_config_info): the router can read each
    # replica's own, and follow it across restarts, rather than be told one number.
    published = any(isinstance(e.get("num_gpu_blocks"), int) for e in engines.values())
    section = {"policy_settings": {"replica_cache_tokens": "auto"}} if published else None
    return [
        Finding(
            "kv_pressure",
            info.name,
            "the engines' KV cache is nearly full" + (" and the hit rate is falling" if falling else ""),
            evidence,
            Fix(
                summary="add replicas or KV memory (vLLM --gpu-memory-utilization, a smaller --max-num-seqs or "
                "--max-model-len); tell the router each replica's real cache size so it stops predicting "
                "evicted prefixes",
                yaml=_route_yaml(info.name, section) if section else None,
                patch={"route": info.name, **section} if section else None,
            ),
            severity=0.7 if falling else 0.3,
            data={"kv_cache_usage": full, "falling": falling},
        )
    ]


def imbalance_spills(info: RouteInfo, live: dict[str, Any]) -> list[Finding]:
    reasons = live.get("reasons") or {}
    total = sum(v for v in reasons.values() if isinstance(v, int | float))
    spills = reasons.get("spill", 0)
    if total < MIN_REQUESTS or spills / total < SPILL_SHARE:
        return []
    share = spills / total
    section = {"policy_settings": {"load_factor": 3, "bound_extra": 4}}  # above the defaults (2, 2)
    return [
        Finding(
            "imbalance_spill",
            info.name,
            f"{_pct(share)} of routing decisions spilled away from the replica holding the prefix",
            [
                f"routing reasons: {dict(sorted(reasons.items()))}",
                "a spill happens when the replica with the cached prefix is over the load bound: its prefix is "
                "recomputed elsewhere",
            ],
            Fix(
                summary="allow more imbalance before spilling (higher load_factor, more bound_extra for long "
                "cached prefixes), or add capacity if the hot replica is truly saturated",
                yaml=_route_yaml(info.name, section),
                patch={"route": info.name, **section},
            ),
            severity=min(1.0, share),
            data={"reasons": reasons, "share": round(share, 4)},
        )
    ]
