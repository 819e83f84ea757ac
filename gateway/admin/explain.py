"""What the gateway would do with a request, and why: ``POST /admin/explain`` and ``prefix-gateway explain``.

The report comes from :meth:`Gateway.plan` with ``dry_run=True`` — the request handler's own
code path (route match, normalize, tokenize, hash, the policy's decision) — so what explain
shows is what the handler would do right now, yet nothing is sent upstream, no in-flight
slot is held, and no policy state changes (the affinity index records nothing, round robin
does not advance): the next real request is placed as if the explain call never happened.

Input (JSON), either a request body as a client would send it — the endpoint is inferred:
``messages`` → chat, ``prompt`` → completions, ``input`` → embeddings — or a wrapper::

    {"endpoint": "chat", "body": {...}, "headers": {"x-session-id": "abc"}}

``headers`` are the *client's* headers the route matcher and session key would see (the
admin request's own headers are never used).  The report holds prompt text (the
normalization diff and the rewritten body): it is returned to the admin caller, never
logged.

This module only builds and renders reports; ``gateway.admin.routes`` (HTTP) and ``gateway.cli``
(offline or remote) call it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.config import GatewayConfig, ReplicaConfig, UpstreamSettings
from gateway.errors import BadRequest, PayloadTooLarge
from gateway.observe.stats import normalization_section
from gateway.proxy.parse import parse_body
from gateway.routing.plan import Plan
from gateway.service import ENDPOINT_PATHS, Gateway
from gateway.upstream.errors import UpstreamConnectError

#: body field → endpoint, in the order they are tried
ENDPOINT_BY_FIELD = (("messages", "chat"), ("prompt", "completions"), ("input", "embeddings"))
_ENDPOINT_ALIASES = {
    **{name: name for name in ENDPOINT_PATHS},
    **{path: name for name, path in ENDPOINT_PATHS.items()},
    **{path.removeprefix("/v1"): name for name, path in ENDPOINT_PATHS.items()},
    "chat/completions": "chat",
}
_WRAPPER_KEYS = frozenset({"endpoint", "body", "headers"})

#: what each policy branch means, for people (``{...}`` filled from the decision)
_GENERIC_WHY = {
    "round_robin": "smooth weighted round robin: {replica} is next in turn",
    "random": "weighted random pick",
    "least_loaded": "{replica} has the fewest in-flight requests per unit of weight",
    "session": "{replica} is the rendezvous-hash home of the session header value",
}


@dataclass(frozen=True, slots=True)
class ExplainInput:
    """One request to explain: which endpoint, its body, and the client headers to assume."""

    endpoint: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


# -- input -----------------------------------------------------------------------------------
def infer_endpoint(body: Mapping[str, Any]) -> str:
    for name, endpoint in ENDPOINT_BY_FIELD:
        if name in body:
            return endpoint
    raise BadRequest(
        "cannot tell the endpoint: give 'endpoint' (chat, completions or embeddings) with the request in "
        "'body', or a body with 'messages' (chat), 'prompt' (completions) or 'input' (embeddings)",
        param="endpoint",
        code="invalid_request",
    )


def parse_input(payload: Any) -> ExplainInput:
    """A bare request body or the ``{endpoint, body, headers}`` wrapper.  Raises BadRequest (400)."""
    if not isinstance(payload, dict):
        raise BadRequest("explain expects a JSON object: a request body or {endpoint, body, headers}")
    if "body" in payload and "model" not in payload:
        unknown = sorted(set(payload) - _WRAPPER_KEYS)
        if unknown:
            raise BadRequest(
                f"unknown field(s) {', '.join(map(repr, unknown))}; the wrapper takes endpoint, body and headers",
                param=unknown[0],
            )
        body = payload["body"]
        if not isinstance(body, dict):
            raise BadRequest("'body' must be a JSON object (the request body)", param="body", code="invalid_type")
        raw_endpoint = payload.get("endpoint")
        if raw_endpoint is None:
            endpoint = infer_endpoint(body)
        elif not isinstance(raw_endpoint, str) or raw_endpoint not in _ENDPOINT_ALIASES:
            raise BadRequest(
                f"'endpoint' must be one of chat, completions, embeddings (got {raw_endpoint!r})",
                param="endpoint",
                code="invalid_value",
            )
        else:
            endpoint = _ENDPOINT_ALIASES[raw_endpoint]
        headers = payload.get("headers") or {}
        if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise BadRequest("'headers' must be an object of string values", param="headers", code="invalid_type")
    else:
        body, endpoint, headers = payload, infer_endpoint(payload), {}
    # The handler's own checks, on the same bytes shape it would see.
    checked = parse_body(json.dumps(body).encode(), endpoint)
    return ExplainInput(endpoint, checked, {k.lower(): v for k, v in headers.items()})


def parse_input_bytes(raw: bytes, limit: int | None = None) -> ExplainInput:
    """Parse the raw JSON of an explain request (400 for bad JSON, 413 over ``limit``)."""
    if limit is not None and len(raw) > limit:
        raise PayloadTooLarge(f"request body of {len(raw)} bytes exceeds the limit of {limit} bytes")
    if not raw.strip():
        raise BadRequest("request body is empty; expected a JSON object", code="invalid_json")
    try:
        payload = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    return parse_input(payload)


# -- the report ------------------------------------------------------------------------------
def explain(gateway: Gateway, request: ExplainInput) -> dict[str, Any]:
    """Dry-run plan of ``request`` and the JSON report (raises the handler's 404/503 errors).

    A client key in the explained request's own ``authorization`` header names its flow, as
    the proxy's would (routing and flow control both read it); a key that is not configured
    names none."""
    keys = gateway.client_keys
    key_hash = keys.identify(request.headers.get("authorization")) if keys.enabled else None
    plan = gateway.plan(request.endpoint, request.body, request.headers, "explain", dry_run=True, key_hash=key_hash)
    report = build_report(plan)
    report["flow_control"] = gateway.flow.explain(plan.route, request.headers, key_hash)
    return report


def build_report(plan: Plan) -> dict[str, Any]:
    route, prepared, decision = plan.route, plan.prepared, plan.decision
    detail = dict(decision.detail or {})
    candidates = {c["replica"]: c for c in detail.pop("candidates", None) or () if isinstance(c, Mapping)}
    report: dict[str, Any] = {
        "dry_run": True,
        "endpoint": plan.endpoint,
        "path": ENDPOINT_PATHS[plan.endpoint],
        "model": plan.request.model,
        "stream": plan.request.stream,
        "session_key": plan.request.session_key is not None,
        "route": {
            "name": route.name,
            "policy": route.policy,
            "normalize": route.normalize_mode if prepared is not None else None,
            "replicas": [r.name for r in route.runner.replicas],
        },
        "normalize": _normalize_section(plan),
        "prefix": None,
        "key": None,
    }
    if prepared is not None:
        pipeline = route.pipeline
        settings = pipeline.settings  # type: ignore[union-attr]
        block = pipeline.block  # type: ignore[union-attr]
        report["prefix"] = {
            "tokenizer": settings.tokenizer,
            # exact only when tokenizer, template and block size match the engine; else why not
            "units": prepared.units,
            "window_tokens": prepared.window_tokens,
            "window_limit": settings.window_tokens,
            "window_full": prepared.window_tokens >= settings.window_tokens,
            "block_size": prepared.block_size,
            "block_size_setting": block.setting,
            "block_size_source": block.source,  # config, engines (auto: the replicas' own) or default
            "engine_block_sizes": dict(sorted(block.engines.items())),
            "block_size_note": block.describe(),  # replicas that disagree, or differ from the route
            "blocks": len(prepared.block_keys),
            "cache_salt": isinstance(prepared.body.get("cache_salt"), str),  # salted: never shares a key
            "base_model": prepared.base_model,  # the engine cache the seed names
            "lora": prepared.lora,
        }
    if "key" in detail and detail.get("key_source") != "none":
        report["key"] = {
            "value": detail.get("key"),
            "source": detail.get("key_source"),
            "depth_blocks": detail.get("key_depth_blocks"),
        }
    report["replicas"] = _replica_rows(plan, candidates)
    report["decision"] = {
        "replica": decision.replica,
        "reason": decision.reason,
        "why": why(plan, candidates),
        "predicted_cached_tokens": plan.predicted_cached_tokens,
        "matched_blocks": detail.get("matched_blocks"),
    }
    if detail.get("over_context"):
        # estimated past max_model_len: forwarded (no certainty), but its engine will refuse it,
        # so the policy records nothing for it
        report["decision"]["over_context"] = {
            "prompt_tokens_estimate": plan.request.prompt_tokens_estimate,
            "max_model_len": plan.request.context_limit,
        }
    report["detail"] = detail
    report["forwarded_body"] = plan.body  # None: the client's bytes are forwarded unchanged
    return report


def _normalize_section(plan: Plan) -> dict[str, Any] | None:
    prepared = plan.prepared
    if prepared is None:
        return None
    mode = plan.route.normalize_mode
    return {
        "mode": mode,
        "rewritten": prepared.relocated,
        "counts": dict(prepared.normalized),  # rule -> spans found (report) or moved (relocate)
        "spans_moved": prepared.spans_moved,
        "canonicalized_tools": prepared.canonicalized,
        "changes": [
            {"where": c.where, "rule": c.rule, "placeholder": c.placeholder, "value": c.value} for c in prepared.changes
        ],
        # detected but left in place: "static" (not seen changing at its place yet) or
        # "protected" (inside code or an embedded JSON document)
        "kept": [{"where": k.where, "rule": k.rule, "status": k.status, "value": k.value} for k in prepared.kept],
        # what the route has learned varies (shapes and suggested rules, as in /admin/stats)
        "learned": normalization_section(mode, plan.route.pipeline.normalizer)["learned"]  # type: ignore[union-attr]
        if plan.route.pipeline is not None
        else [],
    }


def _replica_rows(plan: Plan, candidates: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    # how each replica's match was made: from its engine's KV events, or the gateway's model
    precise = getattr(plan.route.runner.policy, "precise", None)
    for replica in plan.route.runner.replicas:
        engine = replica.engine
        row: dict[str, Any] = {
            "replica": replica.name,
            "healthy": replica.healthy,
            "eligible": replica.healthy,
            "weight": replica.weight,
            # as the policy sees them: this gateway's requests plus its peers' (state.share_load)
            "in_flight": replica.in_flight + replica.peer_in_flight,
            "pending_prefill_tokens": replica.pending_prefill_tokens + replica.peer_pending_prefill_tokens,
            "peer_in_flight": replica.peer_in_flight,
            "chosen": replica.name == plan.decision.replica,
            "engine": None
            if engine is None
            else {
                "kv_cache_usage": engine.kv_cache_usage,
                "waiting": engine.waiting,
                "hit_rate": None if engine.hit_rate is None else round(engine.hit_rate, 4),
                "block_size": replica.block_size,  # as the engine last published it
            },
        }
        if precise is not None:
            row["kv_mode"], row["kv_reason"] = precise.mode_of(replica.name, plan.request.block_size or None)
        candidate = candidates.get(replica.name)
        if candidate is not None:
            keys = ("ring_rank", "bound", "under_bound", "kept_over_bound", "matched_blocks", "matched_tokens", "score")
            for key in keys:
                if key in candidate:
                    row[key] = candidate[key]
        rows.append(row)
    return rows


def why(plan: Plan, candidates: Mapping[str, Mapping[str, Any]]) -> str:
    """One sentence a person can read: why this replica."""
    decision = plan.decision
    detail = decision.detail or {}
    pick = decision.replica
    if "invalid_choice" in detail:
        return f"the policy named an ineligible replica ({detail['invalid_choice']}); least loaded instead"
    if plan.route.policy != "prefix":
        text = _GENERIC_WHY.get(decision.reason)
        if decision.reason == "fallback":
            return "no session key (or no eligible home): least loaded"
        if decision.reason == "spill":
            return f"the session's home is over the load bound; {pick} is the next replica in hash order"
        return text.format(replica=pick) if text else f"policy {plan.route.policy} chose {pick}"
    block_size = int(detail.get("block_size") or plan.request.block_size or 1)
    mine = candidates.get(pick, {})
    matched = int(mine.get("matched_blocks", 0))
    cached = int(mine.get("matched_tokens", matched * block_size))
    cached_text = f"{matched} blocks = {cached} tokens" + (
        " with the history past the window" if cached > matched * block_size else ""
    )
    load = (
        f"{mine.get('in_flight', 0)} in flight, bound {mine.get('bound', '?')}, "
        f"{mine.get('pending_prefill_tokens', 0)} tokens queued for prefill"
    )
    if decision.reason == "fallback":
        return f"no routing key (the prompt is shorter than one {block_size}-token block): least loaded replica"
    if decision.reason == "affinity" and detail.get("kept_over_bound"):
        return (
            f"{pick} recently served the longest prefix of this request ({cached_text}); it is over its "
            f"load bound ({load}), but a spill would not save enough wait to pay for computing that "
            "prefix again (spill_min_saving)"
        )
    if decision.reason == "affinity":
        return (
            f"{pick} recently served the longest prefix of this request ({cached_text}) and is under its "
            f"load bound ({load})"
        )
    key_text = (
        "the session key"
        if detail.get("key_source") == "session"
        else f"the chain key of block {detail.get('key_depth_blocks')}"
    )
    ranked = sorted(candidates.values(), key=lambda c: c.get("ring_rank", 0))
    home = ranked[0]["replica"] if ranked else "the ring's home"
    if decision.reason == "ring":
        if not ranked or home == pick:
            return (
                f"no replica recently served a prefix of this request; {pick} is the home of {key_text} on the "
                f"consistent-hash ring and is under its load bound ({load})"
            )
        return (
            f"no replica recently served a prefix of this request, so none is lost by placing it by load: {pick} "
            f"has the least work ahead of it (in flight and queued prefill; {load}); {home}, the home of "
            f"{key_text} on the ring, is busier"
        )
    # spill: from the affinity branch (scores were computed) or from the ring walk
    if any("score" in c for c in candidates.values()):
        best = max((int(c.get("matched_tokens", 0)) for c in candidates.values()), default=0)
        deeper = [name for name, c in candidates.items() if c.get("matched_tokens", 0) == best and name != pick]
        holder = ", ".join(deeper) or "another replica"
        return (
            f"{holder} holds a longer cached prefix ({best} tokens) but is over its load bound or busier; {pick} "
            f"has the best score of the rest ({cached_text}, {load})"
        )
    return (
        f"{home}, the home of {key_text} on the ring, is over its load bound or busier (in flight and queued "
        f"prefill) than the least busy replica; {pick} is the next acceptable replica on the ring ({load})"
    )


# -- rendering for people --------------------------------------------------------------------
def _short(value: Any, width: int = 60) -> str:
    text = str(value).replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    out += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return out


def render_text(report: Mapping[str, Any]) -> str:
    """The report as a short readable text (``prefix-gateway explain`` without ``--json``)."""
    route = report["route"]
    lines = [
        f"POST {report['path']}  model={report['model']}" + ("  (stream)" if report.get("stream") else ""),
        f"route: {route['name']}  policy={route['policy']}"
        + (f"  normalize={route['normalize']}" if route.get("normalize") else ""),
        "",
    ]
    norm = report.get("normalize")
    if norm is None:
        lines.append("normalization: not applied (this route's policy needs no prefix keys)")
    else:
        counts = ", ".join(f"{rule}={n}" for rule, n in norm["counts"].items()) or "none"
        verb = {"relocate": "moved", "report": "found (not moved)", "off": "scanning off"}.get(norm["mode"], "")
        lines.append(f"normalization ({norm['mode']}): volatile spans {verb}: {counts}")
        if norm["changes"]:
            lines += _table(
                ["where", "rule", "value", "placeholder"],
                [[c["where"], c["rule"], _short(c["value"], 40), c["placeholder"]] for c in norm["changes"]],
            )
        if norm.get("kept"):
            lines.append("  kept in place (static: not seen changing; protected: inside code/JSON):")
            lines += _table(
                ["where", "rule", "status", "value"],
                [[k["where"], k["rule"], k["status"], _short(k["value"], 40)] for k in norm["kept"]],
            )
        if norm.get("learned"):
            lines.append("  learned to vary on this route (pin with the suggested rule in config):")
            lines += _table(
                ["where", "rule", "example", "suggested pattern"],
                [[x["where"], x["rule"], x["example"], x["suggested_rule"]["pattern"]] for x in norm["learned"]],
            )
        if norm.get("canonicalized_tools"):
            lines.append("  tool schemas re-ordered (canonicalize_tools)")
    prefix = report.get("prefix")
    if prefix is not None:
        lines.append(
            f"tokens: {prefix['window_tokens']} in the window (limit {prefix['window_limit']}, "
            f"{prefix['tokenizer']}: {prefix.get('units') or 'no tokens'}) -> "
            f"{prefix['blocks']} blocks of {prefix['block_size']}"
            + ("  [window full: the prompt is longer]" if prefix["window_full"] else "")
        )
        if prefix.get("block_size_note"):
            lines.append(f"  block size: {prefix['block_size_note']}")
        if prefix.get("lora"):
            lines.append(f"  LoRA adapter {prefix['lora']} of {prefix.get('base_model')}: its own engine cache")
    key = report.get("key")
    if key is not None:
        if key["source"] == "session":
            where = "hash of the session header value"
        else:
            depth = key["depth_blocks"] or 0
            block = prefix["block_size"] if prefix is not None else 0
            where = f"chain key of block {depth} = the first {depth * block} tokens"
        lines.append(f"key: {key['value']} ({where})")
    elif prefix is not None:
        lines.append("key: none")
    lines += ["", "replicas:"]
    rows = []
    for r in sorted(report["replicas"], key=lambda r: (r.get("ring_rank") is None, r.get("ring_rank", 0))):
        score = r.get("score")
        rows.append(
            [
                r["replica"],
                "yes" if r["healthy"] else "NO",
                str(r["in_flight"]),
                str(r.get("pending_prefill_tokens", 0)),
                str(r.get("bound", "-")),
                str(r.get("matched_blocks", "-")),
                "-" if score is None else f"{score:.1f}",
                str(r.get("ring_rank", "-")),
                {"precise": "events", "approximate": "model"}.get(r.get("kv_mode", ""), "-"),
                "-" if r["engine"] is None or r["engine"]["hit_rate"] is None else f"{r['engine']['hit_rate']:.1%}",
                "<- chosen" if r["chosen"] else "",
            ]
        )
    header = [
        "replica",
        "healthy",
        "in-flight",
        "queued",
        "bound",
        "matched",
        "score",
        "ring",
        "match by",
        "engine hit",
        "",
    ]
    lines += _table(header, rows)
    decision = report["decision"]
    predicted = decision.get("predicted_cached_tokens")
    lines += [
        "",
        f"decision: {decision['replica']} ({decision['reason']})"
        + ("" if predicted is None else f", predicted cached tokens: {predicted}"),
        f"  why: {decision['why']}",
    ]
    if report.get("forwarded_body") is not None:
        lines.append("  the body is rewritten before forwarding (--json shows it as forwarded_body)")
    return "\n".join(lines)


# -- planning without a running gateway (the CLI's offline mode) ------------------------------
class _OfflineClient:
    """An upstream client that never connects: offline planning must not contact a replica."""

    def __init__(self, replica: ReplicaConfig, settings: UpstreamSettings) -> None:
        self.base_url = replica.url

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> Any:
        raise UpstreamConnectError("offline explain never contacts a replica", before_send=True)

    async def get(self, path: str, timeout_s: float, headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        raise UpstreamConnectError("offline explain never contacts a replica", before_send=True)


def offline_gateway(config: GatewayConfig) -> Gateway:
    """A gateway built from ``config`` that is never started: every replica healthy, idle, unscraped."""
    return Gateway(config, client_factory=_OfflineClient, environ={})
