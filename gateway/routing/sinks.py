"""Where the routing core hands on what it placed: the seams shared state plugs into.

The affinity index (:mod:`gateway.routing.affinity`) and the head-demand counts
(:mod:`gateway.routing.starts`) are routing state; sharing them with other gateway processes
is :mod:`gateway.state`'s job.  So the routing side names what it tells, as these small
protocols, and holds a sink that receives it — :data:`NO_SINK` (nothing shared) until the
state sync attaches its own.  Routing never imports the state layer, and nothing outside an
object replaces its attributes.

A sink is called on the request path, synchronously: it must queue, never wait.
"""

from __future__ import annotations

from typing import Protocol

from gateway.routing.key_weights import KeyWeights


class RecordSink(Protocol):
    """Hears of every affinity record this process makes and takes back (not peers')."""

    def recorded(self, replica: str, stored: list[int], prompt_tokens: int | None, weights: KeyWeights | None) -> None:
        """``replica`` now holds the ``stored`` keys (deepest first); ``prompt_tokens``: the
        prompt's length past its keys; ``weights``: what the keys weigh in the replica's
        modelled KV cache (None: not modelled), read during the call (it may be lazy)."""

    def withdrawn(self, replica: str, keys: list[int]) -> None:
        """A record's ``keys`` (those it added) are taken back: ``replica`` did not serve the
        request (no 2xx answer), so it does not hold them."""


class StartSink(Protocol):
    """Hears of every conversation start this process placed behind a shared head."""

    def started(self, head: int) -> None:
        """A new conversation started behind the shared head ``head``."""


class NoSink:
    """The default sink of both kinds: one gateway process, nothing to tell anyone."""

    __slots__ = ()

    def recorded(self, replica: str, stored: list[int], prompt_tokens: int | None, weights: KeyWeights | None) -> None:
        return None

    def withdrawn(self, replica: str, keys: list[int]) -> None:
        return None

    def started(self, head: int) -> None:
        return None


NO_SINK = NoSink()
