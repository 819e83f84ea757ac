"""A request's plan: everything decided about it before it is sent.

Its own module (not in ``gateway.service``, which makes plans) so that what reads plans —
the proxy, ``/admin/explain``, the sample buffer — can name the type without importing the
assembled gateway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.prefix.pipeline import PreparedPrompt
from gateway.replicas.pool import Replica
from gateway.routing.base import Decision, RequestView
from gateway.routing.routes import Route


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
        """The body to forward when preparation rewrote it, else None (forward the client's bytes)."""
        return self.prepared.body if self.prepared is not None and self.prepared.relocated else None

    @property
    def predicted_units(self) -> str | None:
        """What the prediction is counted in (see :mod:`gateway.tokens.alignment`), when there is one."""
        return self.prepared.units if self.prepared is not None else None

    @property
    def predicted_cached_tokens(self) -> int | None:
        value = self.decision.detail.get("predicted_cached_tokens") if self.decision.detail else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None
