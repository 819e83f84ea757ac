"""The seam precise matching plugs into: what the prefix policy asks of it.

The ``prefix`` policy matches a request against its affinity index (a model of what each
replica caches).  Where replicas publish their engines' KV cache events,
:mod:`gateway.kv_events` knows what they really hold and answers for those replicas
instead.  Routing never imports that package (it imports routing); it names the calls here
and holds a matcher once the gateway attaches one (``PrefixPolicy.attach_precise``).
"""

from __future__ import annotations

from typing import Protocol

from gateway.routing.affinity import AffinityIndex
from gateway.routing.base import RequestView


class PreciseMatcher(Protocol):
    """Answers the policy's matching for replicas whose engines report their caches."""

    def match_groups(self, affinity: AffinityIndex, request: RequestView, want: int) -> list[tuple[int, int]] | None:
        """``affinity.match_groups(request.block_keys, want)`` with the precise replicas'
        depths from their engines; None when none of ``want`` is precise."""

    def chose(self, name: str, request: RequestView) -> None:
        """``name`` was chosen for ``request`` (a committed decision)."""

    def withdraw(self, name: str, request: RequestView) -> None:
        """The attempt on ``name`` failed before an answer."""

    def mode_of(self, name: str, block_size: int | None = None) -> tuple[str, str | None]:
        """("precise", None) or ("approximate", why)."""
