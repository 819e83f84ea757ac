"""Where doctor's evidence comes from: a running gateway's admin API, or a JSONL file.

- :func:`from_gateway`: ``GET /admin/stats`` (required) and ``GET /admin/samples`` (optional:
  when the buffer is off the report says so and skips the replay estimates).
- :func:`from_jsonl`: one OpenAI request body per line (or explain's ``{endpoint, body,
  headers}`` wrapper), matched to a route of ``config`` and keyed by that route's own
  pipeline as it is configured, and again with every detected span relocated.

Both yield the same :class:`~gateway.doctor.model.Corpus`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from gateway.config import GatewayConfig
from gateway.doctor.model import Corpus, Part, RouteInfo, Sample
from gateway.doctor.rekey import Rekeyer, relocating
from gateway.errors import GatewayError
from gateway.observe.samples import Fingerprinter, body_parts, salt_of


class SourceError(Exception):
    """Doctor cannot read its input (unreachable gateway, wrong key, unreadable file)."""


# -- a running gateway -----------------------------------------------------------------------
def _get(client: Any, path: str) -> tuple[int, Any]:
    import httpx

    try:
        response = client.get(path)
    except httpx.HTTPError as exc:
        raise SourceError(f"cannot reach the gateway: {exc}") from None
    try:
        data = response.json()
    except ValueError:
        data = None
    return response.status_code, data


def _error_message(status: int, data: Any) -> str:
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return f"{status}: {message or 'unexpected answer'}"


def from_gateway(url: str, admin_key: str | None, timeout: float = 30.0) -> Corpus:
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    corpus = Corpus(source=base)
    with httpx.Client(base_url=base, headers=headers, timeout=timeout) as client:
        status, stats = _get(client, "/admin/stats")
        if status != 200 or not isinstance(stats, dict):
            raise SourceError(f"GET /admin/stats: {_error_message(status, stats)}")
        corpus.stats = stats
        status, samples = _get(client, "/admin/samples")
    routes_info = samples.get("routes", {}) if status == 200 and isinstance(samples, dict) else {}
    for name, route in (stats.get("routes") or {}).items():
        info = routes_info.get(name) or {}
        corpus.routes[name] = RouteInfo(
            name=name,
            normalize=str(info.get("normalize") or route.get("normalize") or "report"),
            block_size=_route_block_size(info, route),
            tokenizer=str(info.get("tokenizer") or "cl100k_base"),
            policy=str(route.get("policy") or "prefix"),
            cache_blocks=_pooled_blocks(stats, list((route.get("replicas") or {}).keys())),
        )
    if status == 200 and isinstance(samples, dict):
        corpus.samples = [s for s in map(_sample_from_json, samples.get("samples") or []) if s is not None]
        if samples.get("dropped"):
            corpus.notes.append(f"the sample buffer dropped {samples['dropped']} older samples (bounded)")
    elif status == 404:
        corpus.notes.append(
            "the sample buffer is off (samples.enabled: false): no replay estimates; enable it with "
            "`samples: {enabled: true}` in the config to see volatile spans, salts and short prompts"
        )
    else:
        corpus.notes.append(f"GET /admin/samples: {_error_message(status, samples)}")
    return corpus


def _pooled_blocks(stats: dict[str, Any], names: list[str]) -> int | None:
    """The fleet's KV capacity in blocks, when every replica of the route reported it."""
    total = 0
    for name in names:
        engine = ((stats.get("replicas") or {}).get(name) or {}).get("engine") or {}
        blocks = engine.get("num_gpu_blocks")
        if not isinstance(blocks, int) or blocks <= 0:
            return None
        total += blocks
    return total or None


def _sample_from_json(raw: Any) -> Sample | None:
    if not isinstance(raw, dict) or raw.get("status") != 200:
        return None
    block_size = raw.get("block_size")
    keys = raw.get("keys")
    if not isinstance(block_size, int) or not isinstance(keys, list):
        return None  # not keyed (embeddings, or a policy without prefix keys)
    prompt = raw.get("prompt_tokens") or raw.get("window_tokens") or 0
    parts = [
        Part(str(p.get("where")), str(p.get("role")), int(p.get("chars") or 0), str(p.get("fp")))
        for p in raw.get("parts") or []
        if isinstance(p, dict)
    ]
    body = raw.get("body")
    return Sample(
        route=str(raw.get("route")),
        endpoint=str(raw.get("endpoint")),
        model=str(raw.get("model")),
        salt=raw.get("salt"),
        parts=parts,
        block_size=block_size,
        keys=keys,
        prompt_tokens=int(prompt),
        keys_relocated=raw.get("keys_relocated"),
        tokens_relocated=raw.get("tokens_relocated"),
        normalized=dict(raw.get("normalized") or {}),
        spans=[(str(w), str(r)) for w, r in raw.get("spans") or [] if isinstance(w, str)],
        cached_tokens=raw.get("cached_tokens"),
        reason=raw.get("reason"),
        body=body if isinstance(body, dict) else None,
    )


# -- a JSONL file ----------------------------------------------------------------------------
def read_jsonl(path: str | Path) -> tuple[list[Any], list[str]]:
    """Payloads (parsed JSON per line) and problems ("line N: ..."); blank and ``#`` lines are skipped."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror or exc}") from None
    payloads, problems = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            payloads.append(json.loads(line))
        except ValueError as exc:
            problems.append(f"line {n}: not valid JSON ({exc})")
    return payloads, problems


#: requests no route took that get a note of their own (the rest are counted per model)
UNROUTED_EXAMPLES = 10


def from_jsonl(path: str | Path, config: GatewayConfig, cache_blocks: int | None = None) -> Corpus:
    """Key every request of ``path`` through its route's pipeline, as configured and relocating."""
    from gateway.admin.explain import offline_gateway, parse_input

    payloads, problems = read_jsonl(path)
    corpus = Corpus(source=str(path), config=config)
    gateway = offline_gateway(config)
    fp = Fingerprinter()
    current: dict[str, Rekeyer | None] = {}
    relocated: dict[str, Rekeyer | None] = {}
    unrouted: Counter[str] = Counter()  # model -> requests no route took
    for i, payload in enumerate(payloads, 1):
        try:
            request = parse_input(payload)
        except GatewayError as exc:
            problems.append(f"request {i}: {exc.status}: {exc.message}")
            continue
        try:
            route = gateway.route_for(request.endpoint, request.body["model"], request.headers)
        except GatewayError as exc:
            unrouted[str(request.body.get("model"))] += 1
            if sum(unrouted.values()) <= UNROUTED_EXAMPLES:  # the first few verbatim, then one line per model
                problems.append(f"request {i}: {exc.status}: {exc.message}")
            continue
        rc = route.config
        if route.name not in current:
            keyed = route.needs_keys(request.endpoint)
            current[route.name] = rekey = Rekeyer(rc.normalize, rc.prefix) if keyed else None
            relocated[route.name] = (
                Rekeyer(relocating(rc.normalize), rc.prefix) if keyed and rc.normalize.mode != "relocate" else None
            )
            corpus.routes[route.name] = RouteInfo(
                route.name,
                rc.normalize.mode,
                rekey.block_size if rekey else 16,
                rc.prefix.tokenizer,
                rc.policy,
                cache_blocks,
            )
        rekey = current[route.name]
        if rekey is None or request.endpoint not in ("chat", "completions"):
            continue
        body = request.body
        now = rekey.prepare(request.endpoint, body)
        shadow = relocated[route.name]
        moved = shadow.prepare(request.endpoint, body) if shadow is not None else None
        salt = salt_of(body)
        corpus.samples.append(
            Sample(
                route=route.name,
                endpoint=request.endpoint,
                model=str(body["model"]),
                salt=None if salt is None else fp.text(salt),
                parts=[Part(w, r, len(t), fp.text(t)) for w, r, t in body_parts(request.endpoint, body)],
                block_size=now.block_size,
                keys=now.block_keys,
                prompt_tokens=now.prompt_tokens_estimate,
                keys_relocated=None if moved is None else moved.block_keys,
                tokens_relocated=None if moved is None else moved.prompt_tokens_estimate,
                normalized=dict(now.normalized),
                spans=sorted({(c.where, c.rule) for c in (moved or now).changes}),
                body=body,
            )
        )
    corpus.unrouted = dict(unrouted)
    problems.extend(
        f"{count} request{'s' if count != 1 else ''} for model {model!r} matched no route of the config: not analysed"
        for model, count in unrouted.most_common()
    )
    corpus.notes.extend(problems)
    corpus.requests = len(payloads)
    return corpus


#: the route :func:`with_catch_all` adds: it takes every model the config's own routes do not
CATCH_ALL_ROUTE = "any-model"


def with_catch_all(config: GatewayConfig) -> GatewayConfig:
    """``config`` plus a last route that takes every model, with the first prefix route's settings.

    ``doctor --file`` without ``--config`` keys the sample with the default config, whose routes
    serve only the demo's model: without this, another model's traffic would match nothing and
    the report would have nothing to say about it.
    """
    from gateway.config import parse_config

    data = config.model_dump(exclude_unset=True)
    routes = list(data.get("routes") or [])
    if any(r.name == CATCH_ALL_ROUTE for r in config.routes):
        return config
    template = next((r for r in routes if r.get("policy", "prefix") == "prefix"), {})
    catch_all = {"name": CATCH_ALL_ROUTE, "policy": "prefix"}
    for section in ("normalize", "prefix", "policy_settings"):
        if section in template:
            catch_all[section] = template[section]
    data["routes"] = [*routes, catch_all]
    return parse_config(data, "the default config + a route for every model")


def _route_block_size(samples_route: dict[str, Any], stats_route: dict[str, Any]) -> int:
    """The block size the live route hashes with (auto: what it follows from its engines)."""
    size = samples_route.get("block_size")
    if not isinstance(size, int):
        block = stats_route.get("block_size")
        size = block.get("size") if isinstance(block, dict) else None
    return size if isinstance(size, int) and size > 0 else 16
