"""Do the conversations started behind shared heads come back for more turns?

The start rule (:mod:`gateway.routing.starts`) copies a shared head onto more replicas while
its share of new conversations needs them, because a conversation stays where it starts for
every later turn: a start commits load for minutes, and the copy spreads that load before it
piles up.  A start that never comes back commits nothing — a batch job mapping one document
(forty requests in two seconds behind it), a single-turn RAG question.  Copying the head for
such a start costs the head's whole prefill on another replica and a second copy in the
fleet's KV cache, and buys only this request's wait.  Measured on the two-tenant workload
(``bench_virtual.py --workload tenants --quick --seeds 3``): a batch job's burst copied its
3-6k-token document to 2-4 replicas, 2.4 points of hit rate at moderate load, and with the
fleet saturated it lost hits *and* TTFT p90 (1.07x the rule off).

So the policy counts, over recent starts, how many later turns came back to continue one
(pool-wide, decayed like the starts themselves).  A start opens the last keys of its prompt;
a later request whose match ends at one of them (within one stride of the index's match: the
index stores every stride-th key and each prompt's deepest) is its next turn, a *return*,
and opens its own last keys in turn, so a conversation counts every turn.  Until enough
starts are seen the rate leans on a prior: 8 starts (a quarter of the window at most) with one
return each, the old behaviour, so a fresh gateway copies a new tenant's first burst as
before; a fixed few, not one per replica, so that a large fleet's one-shot starts still pull
the rate under the threshold within the window.

Per flow, where the client names one (the fairness header or its API key, as flow control
reads them): a batch tenant's one-shot starts beside a chat tenant's conversations would
otherwise borrow the chat tenant's returns, and every job's burst would be copied for load it
never commits.  A named flow's rate is its own starts and returns with the pool's rate as its
prior (the same 8 starts' weight): a new flow is judged as the pool is until it has a record.
Anonymous requests read the pool's rate, as before.  Measured on ``tenants`` (batch and chat
tenants, ``bench_virtual.py --precise --project --flow --closed-loop --quick --seeds 3``):
``shipped`` minus ``sglang_like``: -1.34 -> -0.54 points at moderate load, -0.24 -> +0.02
at saturation; named conversational tenants (the agent workloads) lost no hit rate.

Per gateway process: a turn placed by another process is not seen here, so with several
processes the rate reads low by about their number (shared state carries starts, not
returns); a threshold of half a return per start keeps four-turn conversations behind three
processes counted as conversations.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from gateway.routing.decay import DecayedCounts

_START, _RETURN = "start", "return"
_OPEN_KEYS = 2  # a prompt's last two keys: the last may be a partial text chunk the next turn extends


class StartReturns(DecayedCounts):
    """Recent starts and the returns that continued them (decayed together: each is an event),
    per named flow too (:class:`FlowReturns`), and the keys where open conversations end (an
    LRU of ``max_open`` keys, each with the flow that opened it)."""

    __slots__ = ("_max_open", "_open", "by_flow", "prior")

    def __init__(self, window: int, max_open: int = 16384, max_flows: int = 4096) -> None:
        super().__init__(window)
        self.prior = max(1.0, min(8.0, window / 4))  # starts, one return each (see the module)
        self.by_flow = FlowReturns(window, max_flows)
        self._max_open = max_open
        # an open end's key -> (the other key of that end, the flow whose conversation it is)
        self._open: OrderedDict[int, tuple[int, str | None]] = OrderedDict()

    def started(self, keys: Sequence[int], flow: str | None = None) -> None:
        """A new conversation behind a shared head was placed with these keys (``flow``: the
        flow its client named, None for an anonymous one)."""
        self._add(_START, 1.0)
        if flow is not None:
            self.by_flow.add(_START, flow)
        self._opens(keys, flow)

    def returned(self, keys: Sequence[int], depth: int, stride: int) -> bool:
        """Whether a request whose best match is ``depth`` keys deep continues an open
        conversation (then counted, for the flow that started it too, and this request's own
        end opened); looks at the keys from ``depth`` to one stride past it, where the previous
        turn's last keys sit."""
        if depth <= 0 or not self._open:
            return False
        opened = self._open
        for i in range(min(len(keys), depth + stride) - 1, depth - 2, -1):
            if keys[i] in opened:
                other, flow = opened.pop(keys[i])
                opened.pop(other, None)  # the end's other key too: a sibling is no return
                self._add(_RETURN, 1.0)
                if flow is not None:
                    self.by_flow.add(_RETURN, flow)
                self._opens(keys, flow)
                return True
        return False

    def rate(self, flow: str | None = None) -> float:
        """Returns per start, recent (the prior's starts with one return each count in); for a
        named ``flow``, its own with the pool's rate as the prior (see the module)."""
        pool = (self.count(_RETURN) + self.prior) / (self.count(_START) + self.prior)
        if flow is None:
            return pool
        starts, returns = self.by_flow.counts(flow)
        return (returns + self.prior * pool) / (starts + self.prior)

    def _opens(self, keys: Sequence[int], flow: str | None) -> None:
        opened = self._open
        end = keys[-_OPEN_KEYS:]
        for key in end:
            opened.pop(key, None)
            opened[key] = (end[0] if key == end[-1] else end[-1], flow)
        while len(opened) > self._max_open:
            opened.popitem(last=False)

    def snapshot(self) -> dict[str, float]:
        """For ``/admin/stats``: recent starts, returns and the rate the start rule reads (the
        pool's; named flows' own are not listed: a client-chosen id is no stats key)."""
        return {
            "recent_starts": round(self.count(_START), 1),
            "recent_returns": round(self.count(_RETURN), 1),
            "returns_per_start": round(self.rate(), 3),
            "flows_tracked": len(self.by_flow),
        }


class FlowReturns(DecayedCounts):
    """Each named flow's recent starts and returns, decayed on the same events as the pool's
    (one step per start or return of a named flow), in an LRU of ``max_flows`` flows (a
    client-chosen id: the bound is what keeps a header's cardinality from growing memory)."""

    __slots__ = ("_flows", "_max_flows")

    def __init__(self, window: int, max_flows: int) -> None:
        super().__init__(window)
        self._max_flows = max_flows
        self._flows: OrderedDict[str, None] = OrderedDict()  # by last start or return, oldest first

    def add(self, kind: str, flow: str) -> None:
        self._add((kind, flow), 1.0)
        flows = self._flows
        flows[flow] = None
        flows.move_to_end(flow)
        while len(flows) > self._max_flows:
            oldest, _ = flows.popitem(last=False)
            self._counts.pop((_START, oldest), None)
            self._counts.pop((_RETURN, oldest), None)

    def counts(self, flow: str) -> tuple[float, float]:
        """(starts, returns) of ``flow``, recent."""
        return self.count((_START, flow)), self.count((_RETURN, flow))

    def __len__(self) -> int:
        return len(self._flows)
