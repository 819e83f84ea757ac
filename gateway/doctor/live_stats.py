"""The causes read from a running gateway's live numbers (``/admin/stats``), not replayed.

Tokenizer or block-size misalignment, KV pressure on the engines, spills away from the cached
replica, spans the gateway learned or found but left in place, and the warm-up of learning
which spans vary: each needs the gateway's and the engines' own counts, so a finding carries
a severity instead of a replayed gain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.doctor.evidence import pct, reported_rate, route_yaml
from gateway.doctor.model import Corpus, Finding, Fix, RouteInfo, Sample

KV_PRESSURE = 0.90  # engine KV usage at or above this is "near full"
MISALIGNED_GAP = 0.10  # predicted minus reported hit rate that points at tokenization
SPILL_SHARE = 0.10  # share of routing decisions that left the cached replica
MIN_REQUESTS = 10  # live-rate findings need at least this many requests behind them


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
                yaml=route_yaml(info.name, section) if rules else None,
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
                yaml=route_yaml(info.name, {"normalize": {"mode": "relocate"}}),
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
            f"{misses} requests ({pct(share)}) kept a volatile value in place while the gateway learned that it varies",
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
                yaml=route_yaml(info.name, section) if section else None,
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


def _block_section(live: dict[str, Any]) -> dict[str, Any]:
    block = live.get("block_size")
    return block if isinstance(block, dict) else {}


def tokenizer_misalignment(corpus: Corpus, info: RouteInfo, live: dict[str, Any]) -> list[Finding]:
    """The route's tokens or blocks do not line up with its engines': the predicted hit rate runs
    ahead of the reported one, the engines publish another block size than the route hashes, or
    the route's replicas disagree among themselves (one route hashes one size)."""
    predicted, reported = live.get("hit_rate_predicted"), live.get("hit_rate_reported")
    evidence = []
    block = _block_section(live)
    engines = block.get("engines") if isinstance(block.get("engines"), dict) else None
    if engines is None:  # an older gateway: read the replicas' engines
        engines = {n: e.get("block_size") for n, e in _engines(corpus, live).items()}
    block_sizes = {b for b in engines.values() if isinstance(b, int)}
    disagree = len(block_sizes) > 1
    hashed = block.get("size") if isinstance(block.get("size"), int) else info.block_size
    wrong_block = sorted(b for b in block_sizes if b != hashed)
    # engines at a multiple of the route's size are keyed at it: matched and predicted exactly
    unmatched = [b for b in wrong_block if not isinstance(hashed, int) or hashed <= 0 or b % hashed]
    if disagree:
        groups: dict[int, list[str]] = {}
        for name, size in sorted(engines.items()):
            if isinstance(size, int):
                groups.setdefault(size, []).append(name)
        evidence.append(
            "the route's replicas use different block sizes: "
            + "; ".join(f"{size} on {', '.join(names)}" for size, names in sorted(groups.items()))
            + f"; the route hashes {hashed}-token blocks"
            + (
                f", so the replicas at {unmatched} are routed by the approximate model and predicted at its granularity"
                if unmatched
                else ", which each engine's is a multiple of: every replica's predictions are cut to its own "
                "whole blocks (and where it publishes KV events it is matched from them), at the cost of more "
                "keys per block on the larger ones"
            )
        )
    elif wrong_block:
        evidence.append(f"the engines use block size {wrong_block}, the route hashes {hashed}-token blocks")
    gap = None
    if (
        isinstance(predicted, int | float)
        and isinstance(reported, int | float)
        and (live.get("predicted_requests") or 0) >= MIN_REQUESTS
    ):
        gap = predicted - reported
        if gap >= MISALIGNED_GAP:
            evidence.append(
                f"the gateway predicted {pct(predicted)} cached, the replicas reported {pct(reported)} "
                f"over {live.get('predicted_requests')} requests: the gateway's tokens or blocks do not line up "
                "with the engines' (or the engines evict: see KV pressure)"
            )
            units = live.get("predicted_units")
            if live.get("predicted_exact") is False and isinstance(units, str):
                evidence.append(f"the predictions are counted as {units}")
    if not evidence:
        return []
    setting = block.get("setting", info.block_size)
    prefix: dict[str, Any] = {"tokenizer": "hf:/path/to/the/model_dir"}
    if wrong_block and not disagree:
        # auto follows the engines; an explicit integer that contradicts them is the fault
        prefix["block_size"] = "auto" if setting != "auto" and block else wrong_block[0]
    if disagree:
        summary = (
            "run every replica of the route with the same --block-size (one route hashes one block size), or "
            "split them into routes by block size"
        )
    else:
        summary = (
            f"hash with the served model's own tokenizer and chat template (now {info.tokenizer}; "
            "`auto` knows Llama 3.x and Qwen2.5/3 by name, `hf:DIR` reads any local model) and the engines' "
            "block size (`block_size: auto` follows them), so predicted blocks are the engines' blocks"
        )
    return [
        Finding(
            "tokenizer_mismatch",
            info.name,
            "the route's replicas disagree on the block size"
            if disagree
            else "the gateway's tokenizer or block size does not match the engines'",
            evidence,
            Fix(
                summary=summary,
                yaml=None if disagree else route_yaml(info.name, {"prefix": prefix}),
                patch=None if disagree else {"route": info.name, "prefix": prefix},
            ),
            severity=max(gap or 0.0, 0.5 if unmatched else 0.2 if wrong_block else 0.0),
            data={
                "gap": None if gap is None else round(gap, 4),
                "engine_block_sizes": sorted(block_sizes),
                "engines": {k: v for k, v in sorted(engines.items()) if isinstance(v, int)},
                "disagree": disagree,
                "hashed_block_size": hashed,
            },
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
        "KV cache usage near full on " + ", ".join(f"{name} {pct(usage)}" for name, usage in sorted(full.items()))
    ]
    falling = False
    known = [s for s in samples if s.cached_tokens is not None and s.prompt_tokens]
    if len(known) >= 2 * MIN_REQUESTS:
        half = len(known) // 2
        first, second = reported_rate(known[:half]), reported_rate(known[half:])
        if first is not None and second is not None:
            evidence.append(
                f"reported hit rate {pct(first)} in the older half of the samples, {pct(second)} in the newer"
            )
            falling = second < first - 0.05
    predicted, reported = live.get("hit_rate_predicted"), live.get("hit_rate_reported")
    if isinstance(predicted, int | float) and isinstance(reported, int | float) and predicted > reported:
        evidence.append(
            f"predicted {pct(predicted)} vs reported {pct(reported)}: cached prefixes are evicted before reuse"
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
                yaml=route_yaml(info.name, section) if section else None,
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
    section = {"policy_settings": {"load_factor": 3, "bound_extra": 8}}  # above the defaults (2, 4)
    return [
        Finding(
            "imbalance_spill",
            info.name,
            f"{pct(share)} of routing decisions spilled away from the replica holding the prefix",
            [
                f"routing reasons: {dict(sorted(reasons.items()))}",
                "a spill happens when the replica with the cached prefix is over the load bound: its prefix is "
                "recomputed elsewhere",
            ],
            Fix(
                summary="allow more imbalance before spilling (higher load_factor, more bound_extra for long "
                "cached prefixes), or add capacity if the hot replica is truly saturated",
                yaml=route_yaml(info.name, section),
                patch={"route": info.name, **section},
            ),
            severity=min(1.0, share),
            data={"reasons": reasons, "share": round(share, 4)},
        )
    ]


def scrape_failing(corpus: Corpus, info: RouteInfo, live: dict[str, Any]) -> list[Finding]:
    """Replicas of the route whose engine scrape fails now: the gateway does not see their
    queues and KV usage (flow control judges them on its own counts; a stale one among fresh
    ones has no room) nor their prefix-cache counters (the reported hit rate leaves them out)."""
    replicas = (corpus.stats or {}).get("replicas") or {}
    failing = {}
    for name in live.get("replicas") or {}:
        row = replicas.get(name) or {}
        if isinstance(row, dict) and row.get("engine_error"):
            failing[name] = row
    if not failing:
        return []
    evidence = []
    for name, row in sorted(failing.items()):
        engine = row.get("engine") if isinstance(row.get("engine"), dict) else None
        last = "never scraped" if engine is None else f"last good scrape {engine.get('age_s', 0):g} s ago"
        evidence.append(f"{name}: {row['engine_error']} ({last})")
    evidence.append(
        "without the engine's numbers the gateway cannot see its waiting queue or KV usage: flow control "
        "judges it on the gateway's own counts, and its prefix-cache hits are missing from the reported rate"
    )
    return [
        Finding(
            "scrape_failing",
            info.name,
            f"route {info.name}: the engine scrape fails on {len(failing)} replica(s)",
            evidence,
            Fix(
                summary="make each replica's scrape.path (default /metrics, vLLM's) reachable from the gateway: "
                "the port, a NetworkPolicy, the replica's auth (replicas[].api_key)"
            ),
            severity=0.6,
            data={"replicas": sorted(failing)},
        )
    ]


def saturated_route(info: RouteInfo, live: dict[str, Any]) -> list[Finding]:
    """The route is saturated now (flow control holds requests, or would): no cache fix helps the
    latency there until the fleet has room — name it first, with what was held, shed and expired."""
    flow = live.get("flow_control")
    if not isinstance(flow, dict) or not (flow.get("saturated") or flow.get("held")):
        return []
    held, shed, expired = flow.get("held") or 0, flow.get("shed") or 0, flow.get("expired") or 0
    since = flow.get("saturated_for_s")
    return [
        Finding(
            "saturated",
            info.name,
            f"route {info.name} is saturated: no eligible replica has room"
            + (f" (for {since:g} s)" if isinstance(since, (int, float)) else ""),
            [
                f"{held} request(s) held in the gateway now; {shed} shed (negative priority), "
                f"{expired} expired (TTL) since start",
                "a replica has no room at any flow_control.saturation limit (queued prefill, in flight, "
                "engine waiting, KV usage, a stale scrape)",
            ],
            Fix(
                summary="add replicas to the route's pool, or raise flow_control.saturation limits if the engines "
                "still have headroom (see docs/flow-control.md, sizing the thresholds)",
            ),
            severity=0.9,
            data={"held": held, "shed": shed, "expired": expired},
        )
    ]
