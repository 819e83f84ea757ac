"""The gateway's queue of held requests: strict priority between bands, fair sharing between
flows within a band, first come first served within a flow; bounded; entries expire.

Fairness within a band is *start-time fair queuing* by prompt tokens (Goyal et al., SFQ),
a deficit scheme without a quantum to tune: each entry gets a virtual start tag
``max(band clock, its flow's last finish)`` and its flow's finish moves on by the entry's
cost (its prompt tokens: the prefill work it will cost a replica); the band dispatches the
flow head with the least tag and its clock becomes that tag.  So flows share dispatched
prompt *work* equally whatever their request sizes or rates — a tenant sending 10x the
requests, or 10x longer prompts, gets one share, not ten — and a flow that was idle starts
at the band's clock: it neither banks credit while quiet nor waits behind the flood's
backlog.  Plain round-robin would count requests, not work, and let a tenant with long
prompts take most of the fleet's prefill.  Costs: push, pop and remove are O(log flows)
(a heap of the flows' heads, stale records dropped lazily), expiry O(log n) per entry
(a heap of deadlines).

Bounds are per band, in requests and in bytes (the request bodies the waiters hold): a push
over either raises :class:`QueueFull`.  The queue is pure — no clock, no asyncio: callers
pass ``now`` (``time.monotonic()`` in the gateway, simulated seconds in the benchmark).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

#: entry states
QUEUED, DISPATCHED, REMOVED, EXPIRED = "queued", "dispatched", "removed", "expired"

#: stale heap records tolerated beyond twice the live ones before a rebuild
_SLACK = 64
#: what one queued entry costs the queue itself, at most (the entry, its heap records, its
#: flow's records — one flow per entry is the worst case, ~820 bytes measured on CPython 3.11;
#: not the caller's item): a band's memory bound is max_requests x this, plus the bodies the
#: waiters hold, bounded by max_bytes
ENTRY_BYTES = 1024

#: (max requests, max bytes, ttl seconds) of a priority's band
BandLimits = Callable[[int], tuple[int, int, float]]


class QueueFull(Exception):
    """The band is at its request or byte bound (the caller answers 429)."""

    def __init__(self, priority: int, what: str) -> None:
        super().__init__(f"flow-control queue of band {priority} is full ({what})")
        self.priority = priority
        self.what = what  # "requests" | "bytes"


class Entry:
    """One held request.  ``item`` is the caller's (the proxy's waiter, the benchmark's request)."""

    __slots__ = (
        "cost",
        "deadline",
        "enqueued_at",
        "flow",
        "item",
        "passed_at",
        "priority",
        "seq",
        "size",
        "state",
        "tag",
    )

    def __init__(
        self, flow: str, priority: int, cost: int, size: int, enqueued_at: float, deadline: float, item: Any, seq: int
    ) -> None:
        self.flow = flow
        self.priority = priority
        self.cost = cost
        self.size = size
        self.enqueued_at = enqueued_at
        self.deadline = deadline
        self.item = item
        self.seq = seq
        self.tag = 0.0  # virtual start time in its band (SFQ)
        # when the dispatcher first held it back for its own replica while another had room
        # (its affinity wait runs from then: gateway.flow.dispatch)
        self.passed_at: float | None = None
        self.state = QUEUED

    def __repr__(self) -> str:
        return f"Entry(flow={self.flow!r}, priority={self.priority}, seq={self.seq}, state={self.state})"


class _Flow:
    __slots__ = ("entries", "finish", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # by seq: O(1) pop-first and remove
        self.finish = 0.0  # virtual finish tag of its last entry


class Band:
    """One priority's queue: fair between flows, FCFS within a flow."""

    __slots__ = ("bytes", "clock", "count", "flows", "heap", "priority")

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.flows: dict[str, _Flow] = {}
        # (head's tag, head's seq, flow): one valid record per non-empty flow, stale ones skipped
        self.heap: list[tuple[float, int, _Flow]] = []
        self.clock = 0.0  # the tag of the entry dispatched last
        self.count = 0
        self.bytes = 0

    def push(self, entry: Entry) -> None:
        flow = self.flows.get(entry.flow)
        if flow is None:
            flow = self.flows[entry.flow] = _Flow(entry.flow)
        start = max(self.clock, flow.finish)
        entry.tag = start
        flow.finish = start + max(1, entry.cost)
        if not flow.entries:
            heapq.heappush(self.heap, (start, entry.seq, flow))
        flow.entries[entry.seq] = entry
        self.count += 1
        self.bytes += entry.size

    def peek(self) -> Entry | None:
        heap = self.heap
        while heap:
            _, seq, flow = heap[0]
            if flow.entries and next(iter(flow.entries)) == seq and self.flows.get(flow.name) is flow:
                return flow.entries[seq]
            heapq.heappop(heap)  # stale: that head left (dispatched, removed, expired)
        return None

    def pop(self) -> Entry | None:
        entry = self.peek()
        if entry is not None:
            self.clock = entry.tag
            self._take(entry)
        return entry

    def remove(self, entry: Entry) -> bool:
        flow = self.flows.get(entry.flow)
        if flow is None or entry.seq not in flow.entries:
            return False
        self._take(entry)
        return True

    def _take(self, entry: Entry) -> None:
        flow = self.flows[entry.flow]
        was_head = next(iter(flow.entries)) == entry.seq
        del flow.entries[entry.seq]
        self.count -= 1
        self.bytes -= entry.size
        if not flow.entries:
            del self.flows[flow.name]  # an idle flow restarts at the band's clock
            flow.entries = OrderedDict()  # a stale heap record may keep the flow: not its grown table
            if not self.count:  # drained: tables grown by a burst go too (dicts never shrink)
                self.heap = []
                self.flows = {}
        elif was_head:
            head = next(iter(flow.entries.values()))
            heapq.heappush(self.heap, (head.tag, head.seq, flow))
        if len(self.heap) > 2 * len(self.flows) + _SLACK:  # stale records: rebuilt, amortized O(1)
            self.heap = [(f.entries[seq].tag, seq, f) for f in self.flows.values() for seq in (next(iter(f.entries)),)]
            heapq.heapify(self.heap)

    def window(self, n: int) -> list[Entry]:
        """The band's first ``n`` entries in fair order (tag, then arrival), from any flow: a
        lazy merge of the flows' queues, whose tags grow within each flow.  The dispatcher's
        look-past candidates (:mod:`gateway.flow.dispatch`)."""
        merge: list[tuple[float, int, Entry, Iterator[Entry]]] = []
        seen: set[int] = set()  # a flow's head may have more than one valid record
        for _, seq, flow in self.heap:
            valid = flow.entries and next(iter(flow.entries)) == seq and self.flows.get(flow.name) is flow
            if valid and id(flow) not in seen:
                seen.add(id(flow))
                entries = iter(flow.entries.values())
                head = next(entries)
                merge.append((head.tag, head.seq, head, entries))
        heapq.heapify(merge)  # seqs are unique: the entries and iterators are never compared
        out: list[Entry] = []
        while merge and len(out) < n:
            _, _, entry, entries = merge[0]
            out.append(entry)
            following = next(entries, None)
            if following is None:
                heapq.heappop(merge)
            else:
                heapq.heapreplace(merge, (following.tag, following.seq, following, entries))
        return out

    def take(self, entry: Entry) -> None:
        """Dispatch ``entry``, any queued one (see :meth:`window`); the band's clock moves to the
        least tag queued, so overtaking the head by look-past credits no flow."""
        head = self.peek()
        self.clock = max(self.clock, head.tag if head is not None else entry.tag)
        self._take(entry)

    def flow_depths(self) -> dict[str, int]:
        return {name: len(flow.entries) for name, flow in self.flows.items()}


class FlowQueue:
    """Held requests of one route, in priority bands (larger priority first)."""

    def __init__(self, limits: BandLimits) -> None:
        self.limits = limits
        self.bands: dict[int, Band] = {}
        self._order: list[int] = []  # priorities, largest first
        self._deadlines: list[tuple[float, int, Entry]] = []
        self._seq = itertools.count()
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def push(self, flow: str, priority: int, cost: int, size: int, now: float, item: Any = None) -> Entry:
        """Queue a request; raises :class:`QueueFull` when its band is at a bound.

        ``cost``: its prompt tokens (fair sharing counts work); ``size``: the bytes it holds."""
        max_requests, max_bytes, ttl = self.limits(priority)
        band = self.bands.get(priority)
        count, held = (band.count, band.bytes) if band is not None else (0, 0)
        if count + 1 > max_requests:
            raise QueueFull(priority, "requests")
        if held + size > max_bytes:
            raise QueueFull(priority, "bytes")
        if band is None:
            band = self.bands[priority] = Band(priority)
            self._order = sorted(self.bands, reverse=True)
        entry = Entry(flow, priority, cost, size, now, now + ttl, item, next(self._seq))
        band.push(entry)
        heapq.heappush(self._deadlines, (entry.deadline, entry.seq, entry))
        self.count += 1
        return entry

    def peek(self) -> Entry | None:
        """The entry to dispatch next: the fair pick of the most important non-empty band."""
        for priority in self._order:
            band = self.bands[priority]
            if band.count:
                return band.peek()
        return None

    def pop(self) -> Entry | None:
        """Take :meth:`peek`'s entry out (dispatched)."""
        entry = self.peek()
        if entry is not None:
            self.bands[entry.priority].pop()
            entry.state = DISPATCHED
            self.count -= 1
            self._compact()
        return entry

    def candidates(self, n: int) -> list[Entry]:
        """Up to ``n`` entries that may leave next, in fair order, from the most important non-empty band."""
        for priority in self._order:
            band = self.bands[priority]
            if band.count:
                return band.window(n)
        return []

    def take(self, entry: Entry) -> None:
        """Dispatch ``entry``, one of :meth:`candidates` (``pop`` is ``take(peek())``)."""
        self.bands[entry.priority].take(entry)
        entry.state = DISPATCHED
        self.count -= 1
        self._compact()

    def remove(self, entry: Entry) -> bool:
        """Take ``entry`` out wherever it is (its client left); False if it was not queued."""
        if entry.state != QUEUED:
            return False
        band = self.bands.get(entry.priority)
        if band is None or not band.remove(entry):
            return False
        entry.state = REMOVED
        entry.item = None  # the caller holds what it needs; the deadline record must not keep it alive
        self.count -= 1
        self._compact()
        return True

    def _compact(self) -> None:
        """Drop the deadline records of entries gone some other way once they outnumber the queued."""
        if len(self._deadlines) > 2 * self.count + _SLACK:
            self._deadlines = [d for d in self._deadlines if d[2].state == QUEUED]
            heapq.heapify(self._deadlines)

    def expire(self, now: float) -> list[Entry]:
        """Take out every entry whose deadline passed; returns them (oldest deadline first)."""
        out = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, _, entry = heapq.heappop(deadlines)
            if entry.state == QUEUED and self.bands[entry.priority].remove(entry):
                entry.state = EXPIRED
                self.count -= 1
                out.append(entry)
        if not self.count:
            deadlines.clear()  # records of entries that left some other way
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline of a queued entry (when the caller's timer should fire)."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][2].state != QUEUED:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def entries(self) -> Iterator[Entry]:
        """Every queued entry, bands in priority order (for a shutdown or a reload that drops the queue)."""
        for priority in list(self._order):
            for flow in list(self.bands[priority].flows.values()):
                yield from list(flow.entries.values())

    def ahead_of(self, entry: Entry) -> dict[int, int]:
        """Queued entries per more important band than ``entry``'s (explain: "behind band 1")."""
        return {p: self.bands[p].count for p in self._order if p > entry.priority and self.bands[p].count}

    def snapshot(self) -> dict[int, dict[str, Any]]:
        """Per band: depth, bytes and queued per flow."""
        return {
            p: {"depth": b.count, "bytes": b.bytes, "flows": b.flow_depths()}
            for p, b in ((p, self.bands[p]) for p in self._order)
            if b.count
        }
