"""Which flows a route served recently: the own-flow copy rule's precondition.

The prefix policy does not copy a shared head to save a request's wait behind its own flow's
queued work (``head_copy_own_flow_wait``, :mod:`gateway.routing.policies.prefix`): the copy
would run on the least-queued replica, in front of the *other* flows' next requests.  With no
other flow on the route (one client key, one tenant) there is nobody to run in front of, and
the copy is the old trade — the head's prefill for this request's wait — so the rule applies
only while another flow (an anonymous request counts as one) sent one of the route's last
``window`` requests.  Per gateway process, in O(1): a dict of flows in order of their last
request, bounded.
"""

from __future__ import annotations

from collections import OrderedDict


class RecentFlows:
    """The flows of a route's recent requests, most recent last (at most ``max_flows``)."""

    __slots__ = ("_last", "_max_flows", "_seq", "window")

    def __init__(self, window: int, max_flows: int = 4096) -> None:
        self.window = window
        self._max_flows = max_flows
        self._seq = 0  # requests seen
        self._last: OrderedDict[str | None, int] = OrderedDict()  # flow -> its last request's number

    def seen(self, flow: str | None) -> None:
        """A request of ``flow`` (None: anonymous) was placed."""
        self._seq += 1
        last = self._last
        last[flow] = self._seq
        last.move_to_end(flow)
        if len(last) > self._max_flows:
            last.popitem(last=False)

    def others_within(self, flow: str | None) -> bool:
        """Whether a flow other than ``flow`` sent one of the last ``window`` requests (looks at
        two entries at most: the newest other flow is the newest or the one before it)."""
        for other, seq in reversed(self._last.items()):
            if other != flow:
                return self._seq - seq < self.window
        return False
