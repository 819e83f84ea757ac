"""A request's plan: everything decided about it before it is sent.

Its own module (not in ``gateway.service``, which makes plans) so that what reads plans —
the proxy, ``/admin/explain``, the sample buffer — can name the type without importing the
assembled gateway.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from gateway.prefix.pipeline import PreparedPrompt
from gateway.replicas.pool import Replica
from gateway.routing.base import Decision, RequestView
from gateway.routing.routes import Route


def forwarded_body(prepared: PreparedPrompt | None) -> dict[str, Any] | None:
    """The body to forward when preparation rewrote it, else None (forward the client's bytes)."""
    return prepared.body if prepared is not None and prepared.relocated else None


@dataclass(frozen=True, slots=True)
class Draft:
    """A request routed and prepared, not yet placed: what flow control holds while a route
    is saturated, so the decision (``Gateway.decide``) happens when it is dispatched."""

    route: Route
    endpoint: str
    prepared: PreparedPrompt | None
    request: RequestView

    @property
    def body(self) -> dict[str, Any] | None:
        return forwarded_body(self.prepared)


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything decided about a request before it is sent."""

    route: Route
    endpoint: str
    prepared: PreparedPrompt | None  # None when the route's policy needs no prefix keys
    request: RequestView
    decision: Decision
    replica: Replica

    @property
    def body(self) -> dict[str, Any] | None:
        return forwarded_body(self.prepared)

    @property
    def predicted_units(self) -> str | None:
        """What the prediction is counted in (see :mod:`gateway.tokens.alignment`), when there is
        one: for the replica it went to (in a fleet that disagrees on the block size, a replica
        at the route's own size is not mislabelled with the others' mismatch)."""
        prepared = self.prepared
        if prepared is None:
            return None
        pipeline = self.route.pipeline
        if pipeline is None or not pipeline.block_mismatched or prepared.base_model is None:
            return prepared.units
        return pipeline.units_on(prepared.base_model, self.replica.block_size)

    @property
    def predicted_cached_tokens(self) -> int | None:
        value = self.decision.detail.get("predicted_cached_tokens") if self.decision.detail else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def decide(draft: Draft, exclude: Collection[str] = (), *, dry_run: bool = False) -> Plan:
    """Place a prepared request: the route policy's decision among the eligible replicas not
    in ``exclude`` (flow control excludes the ones with no room; a retry the ones tried)."""
    decision, replica = draft.route.runner.decide(draft.request, exclude, dry_run=dry_run)
    return Plan(draft.route, draft.endpoint, draft.prepared, draft.request, decision, replica)
