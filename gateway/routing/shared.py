"""The stateful parts of the routes' policies that gateway processes share with each other.

With ``state.backend: redis`` each process publishes what these learn and applies its peers'
(``gateway.state.affinity_sync``).  They are looked up per route here, once when the gateway
is built and again after a config reload rebuilt routes, so the sync always holds the parts
of the routes that serve now.
"""

from __future__ import annotations

from typing import TypeVar

from gateway.prefix.learn import VarianceLearner
from gateway.routing.affinity import AffinityIndex
from gateway.routing.routes import Route
from gateway.routing.starts import HeadDemand
from gateway.state.record_bounds import max_record_keys, relocated_bytes

T = TypeVar("T")


def _policy_parts(routes: list[Route], attribute: str, kind: type[T]) -> dict[str, T]:
    """Each route's policy ``attribute``, for the policies whose one is a ``kind``."""
    parts = {}
    for route in routes:
        part = getattr(route.runner.policy, attribute, None)
        if isinstance(part, kind):
            parts[route.name] = part
    return parts


def prefix_indexes(routes: list[Route]) -> dict[str, AffinityIndex]:
    """Each route's affinity index, for the policies that have one (shared through Redis)."""
    return _policy_parts(routes, "index", AffinityIndex)


def prefix_learners(routes: list[Route]) -> dict[str, VarianceLearner]:
    """Each route's normalization learner (places seen to vary), for routes that normalize prompts."""
    return {route.name: route.pipeline.normalizer.learner for route in routes if route.pipeline is not None}


def prefix_demands(routes: list[Route]) -> dict[str, HeadDemand]:
    """Each route's shared-head start counts, for the policies that keep them (shared through Redis)."""
    return _policy_parts(routes, "demand", HeadDemand)


def prefix_key_caps(routes: list[Route], body_bytes: int) -> dict[str, int]:
    """Each shared route's most keys per affinity record: what a ``body_bytes`` prompt can produce
    under its window, block, chunk and stride settings (:mod:`gateway.state.record_bounds`)."""
    indexes = prefix_indexes(routes)
    caps = {}
    for route in routes:
        index = indexes.get(route.name)
        if index is not None and route.pipeline is not None:
            s, n = route.pipeline.settings, route.pipeline.normalize_settings
            relocated = relocated_bytes(n.mode, max(n.max_scan_chars, n.completion_prefix_chars))
            # the index's stride follows the block size (PrefixPolicySettings.stride_for)
            stride_for = getattr(getattr(route.runner.policy, "settings", None), "stride_for", None)
            # ``auto``: the engines pick the size, any size down to one token per block
            sizes = [s.block_size] if isinstance(s.block_size, int) else range(1, max(1, s.window_tokens) + 1)
            caps[route.name] = max(
                max_record_keys(
                    body_bytes,
                    s.window_tokens,
                    size,
                    s.chunk_bytes,
                    stride_for(size) if stride_for is not None else index.stride,
                    relocated,
                )
                for size in sizes
            )
    return caps
