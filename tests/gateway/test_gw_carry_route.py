"""What a reloaded route keeps (``gateway.routing.routes.carry_route``): its prompt pipeline and
what it learned stay while ``normalize`` and ``prefix`` do; a change of either resets only its part.

The reload through a changed config file, end to end, is in
``tests/e2e_prefix/test_e2e_reload_learning.py``.
"""

from __future__ import annotations

from typing import Any

from gateway.config import HealthSettings, ReplicaConfig, RouteConfig
from gateway.replicas.pool import Replica
from gateway.routing.routes import Route, build_route, carry_route
from tests.configs import gateway_config

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def route_config(**fields: Any) -> RouteConfig:
    route = {"name": "main", "match": {"models": ["m"]}, "policy": "prefix", "normalize": {"mode": "relocate"}}
    return gateway_config(URLS, routes=[{**route, **fields}]).routes[0]


class NullClient:
    base_url = "http://unused"  # no request is sent: routes are built, never used


def pool() -> list[Replica]:
    return [Replica(ReplicaConfig(name=f"r{i}", url=url), NullClient(), HealthSettings()) for i, url in enumerate(URLS)]


def learned_route() -> Route:
    route = build_route(route_config(), pool())
    assert route.pipeline is not None
    learner = route.pipeline.normalizer.learner
    learner.record("iso_datetime", "system", "Now: \x00.", "2025-03-04T05:06:07Z")
    assert learner.record("iso_datetime", "system", "Now: \x00.", "2025-03-04T05:06:08Z")  # seen to vary
    return route


def test_a_change_of_the_match_list_keeps_the_pipeline_and_what_it_learned() -> None:
    old = learned_route()
    new = carry_route(old, route_config(match={"models": ["m", "m-2"]}), pool)
    assert new.config.match.models == ["m", "m-2"]
    assert new.pipeline is old.pipeline and new.runner is old.runner
    assert new.pipeline is not None and len(new.pipeline.normalizer.learner) == 1


def test_a_new_policy_keeps_the_pipeline_too() -> None:
    old = learned_route()
    new = carry_route(old, route_config(policy_settings={"load_factor": 2.0}), pool)
    assert new.runner is not old.runner  # a fresh runner: its affinity index starts empty
    assert new.pipeline is old.pipeline


def test_a_normalize_change_resets_the_learned_places_and_keeps_the_tokenizers() -> None:
    old = learned_route()
    assert old.pipeline is not None
    new = carry_route(old, route_config(normalize={"mode": "relocate", "roles": ["system"]}), pool)
    assert new.pipeline is not None and new.pipeline is not old.pipeline
    assert len(new.pipeline.normalizer.learner) == 0 and new.pipeline.normalize_settings.roles == ["system"]
    assert new.pipeline.tokens is old.pipeline.tokens  # the segment token cache stays


def test_a_prefix_change_resets_the_tokenizers_and_keeps_the_learned_places() -> None:
    old = learned_route()
    assert old.pipeline is not None
    new = carry_route(old, route_config(prefix={"window_tokens": 2048}), pool)
    assert new.pipeline is not None and new.pipeline.tokens is not old.pipeline.tokens
    assert new.pipeline.tokens.window == 2048
    assert new.pipeline.normalizer is old.pipeline.normalizer
    assert new.runner is not old.runner  # prefix settings shape the keys: a fresh affinity index
