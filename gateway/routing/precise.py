"""The seam precise matching plugs into: what the prefix policy asks of it.

The ``prefix`` policy matches a request against its affinity index (a model of what each
replica caches).  Where replicas publish their engines' KV cache events,
:mod:`gateway.kv_events` knows what they really hold and answers for those replicas
instead.  Routing never imports that package (it imports routing); it names the calls here
and holds a matcher once the gateway attaches one (``PrefixPolicy.attach_precise``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from gateway.routing.affinity import AffinityIndex
from gateway.routing.base import RequestView


class PreciseMatcher(Protocol):
    """Answers the policy's matching for replicas whose engines report their caches."""

    def match_groups(
        self,
        affinity: AffinityIndex,
        request: RequestView,
        want: int,
        pending: Callable[[str], int] | None = None,
    ) -> list[tuple[int, int]] | None:
        """``affinity.match_groups(request.block_keys, want)`` with the precise replicas'
        depths from their engines as they will be when the request runs there, after the
        ``pending(name)`` uncached prompt tokens queued ahead of it; None when none of
        ``want`` is precise."""

    def expected_depth(self, name: str, request: RequestView, depth: int) -> int:
        """Of the ``depth`` keys of ``request`` matched on ``name`` (by the last
        :meth:`match_groups`), how many it will still hold when the request runs there
        (``depth`` 0: what it holds below the depth a match must reach to be routed on)."""

    def held_tokens(self, name: str, request: RequestView) -> int | None:
        """The most prompt tokens of ``request`` that ``name``'s engine holds now, by its own
        events past the token window (by the last :meth:`match_groups`; None: no bound)."""

    def fork_tokens(self, name: str, request: RequestView, depth: int) -> int:
        """Prompt tokens ``name`` holds of ``request`` past its first ``depth`` keys' end, where
        the request parts inside the next text chunk from one held there (0: none known)."""

    def live(self) -> frozenset[str]:
        """The replicas matched from their engines' events now."""

    def chose(self, name: str, request: RequestView, pending_tokens: int = 0) -> None:
        """``name`` was chosen for ``request`` (a committed decision), with ``pending_tokens``
        uncached prompt tokens queued ahead of it there."""

    def finished(self, name: str, request: RequestView) -> None:
        """``name`` served ``request`` to its end: the engine freed its blocks just now."""

    def withdraw(self, name: str, request: RequestView) -> None:
        """The attempt on ``name`` failed before an answer."""

    def mode_of(self, name: str, block_size: int | None = None) -> tuple[str, str | None]:
        """("precise", None) or ("approximate", why)."""

    def key_route(self, route: str, block_size: int, names: Iterable[str]) -> None:
        """``route`` hashes ``block_size``-token blocks over replicas ``names`` (its engines'
        blocks are keyed at that size where theirs is a multiple of it)."""
