"""The replayable causes of a low hit rate: what the samples themselves show, and what fixing it gains.

Each cause finds its evidence in one route's samples (volatile spans the route's detectors or
no rule knows, cache salts that split a shared prefix, prompts shorter than a block, a user
turn before the stable prefix, varying parts without a rule) and, where the fix changes the
keys, registers it as a fixer: the gain is the samples' key chains replayed through an LRU
cache of blocks (:mod:`.replay`) with and without it.  The chains come from the gateway's own
pipeline (:mod:`.rekey`), so a prediction is what the fixed gateway would compute.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from gateway.doctor.evidence import pct, route_yaml
from gateway.doctor.model import STABLE_ROLES, Corpus, Finding, Fix, RouteInfo, RouteSummary, Sample
from gateway.doctor.rekey import Rekeyer, relocating
from gateway.doctor.replay import Request, replay
from gateway.doctor.spans import LearnedSpan, find_spans
from gateway.observe.samples import body_parts
from gateway.prefix.settings import NormalizeSettings, PrefixSettings

CHARS_PER_TOKEN = 4  # estimate for text doctor can only measure in characters

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
            yaml=route_yaml(self.info.name, {"normalize": {"mode": "relocate"}}),
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
                yaml=route_yaml(self.info.name, section),
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
                    prefix = route.prefix
                    if prefix.block_size == "auto":  # key at the size the live route hashed with
                        prefix = prefix.model_copy(update={"block_size": self.info.block_size})
                    return route.normalize, prefix
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
                f"{len(short)} of {len(self.samples)} requests ({pct(share)}) are shorter than one "
                f"{bs}-token block: they can never be served from cache",
                [
                    f"prompt lengths {min(s.prompt_tokens for s in short)}..{max(s.prompt_tokens for s in short)} "
                    f"tokens; vLLM caches whole blocks of {bs} tokens and always computes the last token",
                    f"they are {pct(tokens / total)} of the prompt tokens: per-request hit rates drop, "
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
