"""Routes: which requests go to which pool, under which policy and prefix settings.

A :class:`Route` bundles what the request path needs for one configured route: its matcher,
its :class:`PolicyRunner`, and — for policies that need prefix keys — its
:class:`PrefixPipeline`.  Routes are matched in config order; the first match wins.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.config import RouteConfig
from gateway.prefix.identity import ModelIdentities
from gateway.prefix.pipeline import PrefixPipeline, PreparedPrompt
from gateway.replicas.pool import Replica
from gateway.routing import registry
from gateway.routing.base import RequestView
from gateway.routing.precise import PreciseMatcher
from gateway.routing.runner import PolicyRunner


@dataclass(frozen=True, slots=True)
class Route:
    name: str
    config: RouteConfig
    runner: PolicyRunner
    pipeline: PrefixPipeline | None  # set when the policy needs prefix keys
    endpoints: frozenset[str]
    session_header: str  # lower-case

    @property
    def policy(self) -> str:
        return self.runner.policy_name

    @property
    def normalize_mode(self) -> str:
        return self.config.normalize.mode

    def needs_keys(self, endpoint: str) -> bool:
        return self.pipeline is not None and endpoint in ("chat", "completions")

    def attach_precise(self, matcher: PreciseMatcher | None) -> None:
        """Match precise replicas through ``matcher`` from now on (None: the model only); text
        chunks get fork prints while one of them publishes events (only it reads them)."""
        attach = getattr(self.runner.policy, "attach_precise", None)
        if not callable(attach):
            return
        attach(matcher)
        if self.pipeline is not None:
            self.pipeline.fork_gate = None if matcher is None else (lambda: bool(matcher.live()))
            self.pipeline.engine_stamp = None  # the next follow_engines tells the matcher the block size

    def follow_engines(self) -> None:
        """Let the pipeline re-choose its block size from the replicas' scraped ones
        (``prefix.block_size: auto``), only when one changed or the pool did: a request
        normally pays one comparison."""
        pipeline = self.pipeline
        if pipeline is None:
            return
        replicas = self.runner.replicas
        stamp = pipeline.engine_stamp
        if stamp is not None and stamp[0] == Replica.block_size_epoch and stamp[1] is replicas:
            return
        pipeline.engine_stamp = (Replica.block_size_epoch, replicas)
        choice = pipeline.follow_engines(engine_block_sizes(replicas))
        precise = getattr(self.runner.policy, "precise", None)
        # replicas at a multiple of the route's size are keyed at it; not on the default's guess
        # (no scrape yet): events keyed at 16 would all be dropped once the engines say 128
        if precise is not None and choice.source != "default":
            precise.key_route(self.name, choice.size, [replica.name for replica in replicas])

    def learn_prompt_tokens(self, request: RequestView, prompt_tokens: int | None) -> None:
        """A served request's reply counted its prompt: past the token window, where the
        gateway only estimated it, the count anchors the next turn's keys (see
        :mod:`gateway.prefix.anchors`)."""
        pipeline = self.pipeline
        texts = request.key_tokens
        if pipeline is None or not prompt_tokens or not texts:
            return
        keys = request.block_keys[len(request.block_keys) - len(texts) :]
        window = request.prompt_tokens or 0
        pipeline.anchors.learn(keys, texts, prompt_tokens, request.prompt_tokens_estimate or 0, window)


def engine_block_sizes(replicas: Sequence[Replica]) -> dict[str, int]:
    """replica -> the block size its engine published (replicas not scraped yet are left out)."""
    return {replica.name: replica.block_size for replica in replicas if replica.block_size}


def request_view(
    route: str,
    endpoint: str,
    body: Mapping[str, Any],
    prepared: PreparedPrompt | None,
    session_key: str | None = None,
    request_id: str = "",
    flow: str | None = None,
    context_limit: int | None = None,
) -> RequestView:
    """What a policy sees of one request: its route, model, session and the prepared prompt's keys.

    The one place a :class:`RequestView` is built from a :class:`PreparedPrompt` (the request
    path, ``/admin/explain`` and the benchmarks that drive the policy runner directly).
    """
    return RequestView(
        request_id,
        route,
        str(body.get("model", "")),
        endpoint,
        session_key=session_key,
        block_keys=prepared.keys if prepared else (),
        block_size=prepared.block_size if prepared else 0,
        prompt_tokens=prepared.window_tokens if prepared else None,
        prompt_tokens_estimate=prepared.prompt_tokens_estimate if prepared else None,
        stream=body.get("stream") is True,
        token_blocks=len(prepared.block_keys) if prepared else None,
        key_tokens=prepared.text_key_tokens if prepared else (),
        key_forks=prepared.text_forks if prepared else None,
        flow=flow,
        context_limit=context_limit,
    )


def build_route(
    config: RouteConfig,
    pool: Sequence[Replica],
    old_pipeline: PrefixPipeline | None = None,
    identities: ModelIdentities | None = None,
) -> Route:
    """Phase two for one route: build its policy (from the registry) and pipeline (keeping
    what ``old_pipeline``, the route's before a reload, learned where still valid).

    ``identities``: the gateway's table of LoRA adapters (from the replicas' ``/v1/models``),
    shared by every route's pipeline."""
    entry = registry.entry(config.policy)
    members = [r.view() for r in pool]
    policy = registry.build_policy(config.policy, config.policy_settings, members)
    pipeline = _pipeline(config, old_pipeline, identities) if entry.needs_prefix_keys else None
    return Route(
        name=config.name,
        config=config,
        runner=PolicyRunner(config.name, config.policy, policy, pool),
        pipeline=pipeline,
        endpoints=frozenset(config.endpoints),
        session_header=config.session_header.lower(),
    )


def carry_route(
    old: Route | None,
    config: RouteConfig,
    pool: Callable[[], Sequence[Replica]],
    identities: ModelIdentities | None = None,
) -> Route:
    """The route to serve ``config`` with after a reload: ``old`` itself when its config is
    unchanged; old's runner (ring, affinity index, round-robin turn) with the new matching
    when policy, policy settings and prefix settings are unchanged; else a new route over
    ``pool()``.  Either way the prompt pipeline, and what it learned, stays while the route's
    ``normalize`` and ``prefix`` settings do (:meth:`PrefixPipeline.reconfigured`): a change
    of the match list, endpoints or pool must not bring back a warm-up miss per template."""
    if old is not None and old.config == config:
        return old
    if old is not None and _same_policy(old.config, config):
        return dataclasses.replace(
            old,
            config=config,
            pipeline=_pipeline(config, old.pipeline, identities) if old.pipeline is not None else None,
            endpoints=frozenset(config.endpoints),
            session_header=config.session_header.lower(),
        )
    return build_route(config, pool(), old.pipeline if old is not None else None, identities)


def _pipeline(config: RouteConfig, old: PrefixPipeline | None, identities: ModelIdentities | None) -> PrefixPipeline:
    if old is None:
        return PrefixPipeline(config.normalize, config.prefix, identities)
    return old.reconfigured(config.normalize, config.prefix)


def _same_policy(old: RouteConfig, new: RouteConfig) -> bool:
    return (old.policy, old.policy_settings, old.prefix) == (new.policy, new.policy_settings, new.prefix)


class RouteTable:
    """First-match lookup by model name, optional header, and endpoint."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = list(routes)
        self._by_name = {r.name: r for r in self.routes}
        # Fast path: a model listed by name in routes that come before any pattern/header route.
        self._exact: dict[str, list[Route]] = {}
        for route in self.routes:
            m = route.config.match
            if m.header is not None or any(any(ch in p for ch in "*?[") for p in m.models):
                break
            for model in m.models:
                self._exact.setdefault(model, []).append(route)

    def get(self, name: str) -> Route | None:
        return self._by_name.get(name)

    def match(self, model: str, headers: Mapping[str, str], endpoint: str) -> Route | None:
        for route in self._exact.get(model, ()):
            if endpoint in route.endpoints:
                return route
        for route in self.routes:
            if endpoint in route.endpoints and route.config.match.matches(model, headers):
                return route
        return None

    def serves_model(self, model: str, headers: Mapping[str, str]) -> bool:
        """Does any route take this model (on any endpoint)?"""
        return any(route.config.match.matches(model, headers) for route in self.routes)
