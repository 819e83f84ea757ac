"""The one place where routing policies are registered by name.

Each entry binds a policy name to its factory (``PolicyFactory``: ``(settings, members) ->
Policy``), its typed settings model, and whether the request path must compute prefix block
keys before calling it.  The config loader validates ``policy`` and ``policy_settings``
against this table (an unknown name is an error listing the valid ones) and the runner
builds policies from it, so there is exactly one name → policy switchboard.

Adding a policy is one line in ``POLICIES``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.routing.base import Policy, PolicyFactory, PolicySettings, ReplicaView
from gateway.routing.policies.least_loaded import LeastLoadedPolicy, LeastLoadedSettings
from gateway.routing.policies.prefix import PrefixPolicy, PrefixPolicySettings
from gateway.routing.policies.random import RandomPolicy, RandomSettings
from gateway.routing.policies.round_robin import RoundRobinPolicy, RoundRobinSettings
from gateway.routing.policies.session import SessionPolicy, SessionSettings


@dataclass(frozen=True, slots=True)
class PolicyEntry:
    """How to build and configure one policy."""

    factory: PolicyFactory
    settings_model: type[PolicySettings]
    #: the handler runs ``PrefixPipeline.prepare`` and fills ``RequestView.block_keys``
    needs_prefix_keys: bool = False


POLICIES: dict[str, PolicyEntry] = {
    "round_robin": PolicyEntry(RoundRobinPolicy, RoundRobinSettings),
    "random": PolicyEntry(RandomPolicy, RandomSettings),
    "least_loaded": PolicyEntry(LeastLoadedPolicy, LeastLoadedSettings),
    "session": PolicyEntry(SessionPolicy, SessionSettings),
    "prefix": PolicyEntry(PrefixPolicy, PrefixPolicySettings, needs_prefix_keys=True),
}


def policy_names() -> list[str]:
    return sorted(POLICIES)


def entry(name: str) -> PolicyEntry:
    try:
        return POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; valid policies: {', '.join(policy_names())}") from None


def validate_settings(name: str, raw: Mapping[str, Any] | PolicySettings | None) -> PolicySettings:
    """Validate raw settings with the policy's model (raises pydantic's ``ValidationError``)."""
    model = entry(name).settings_model
    if isinstance(raw, model):
        return raw
    return model.model_validate(dict(raw or {}))


def build_policy(
    name: str, settings: Mapping[str, Any] | PolicySettings | None, members: Sequence[ReplicaView]
) -> Policy:
    """Build a policy instance for one route's pool."""
    return entry(name).factory(validate_settings(name, settings), members)
