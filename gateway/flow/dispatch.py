"""Which held requests go now, and where: late binding over a :class:`FlowQueue` (pure).

A held request is *placed* (the route policy's decision) only when it is dispatched, so it
goes where its prefix is cached if that replica has room at that moment — not where it
would have been queued seconds earlier.  The :class:`Placer` is the route's side: which
replicas have room now, and "decide among these, and count it there" (the gateway's
``PolicyRunner.decide(exclude=the full ones)`` + ``acquire``; the benchmark's simulated
fleet).  Each placement changes the gateway's own counts, so the next ``with_room`` already
sees it: a freed replica takes as many requests as it has room for, no more.

Head of line.  The queue's head is the only candidate (strict priority, then fairness): a
dispatcher that looked past it for a request whose favourite replica has room would let
the fairness order be overtaken by whoever happens to share a prefix with the freed
replica.  When the head's favourite replica is full and another has room, the policy picks
among those with room — the prefix policy's bounded loads spill exactly like that when
the route is not saturated, so saturation does not change where prefixes live, only when
requests leave.  ``affinity_wait_s`` (default 0) lets the head wait that long for its
favourite first, holding the queue behind it: worth it only where a prefix hit saves more
than the wait costs everyone behind it (long shared prompts).

Admission (:func:`admit`): with nothing queued and room somewhere, a request goes at once
(the fast path: no queue touched); with the route saturated, a negative-priority request is
shed (429), anything else queues; with requests already queued, a new one queues behind
them (it may still leave in the same step if it is the fair pick).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from gateway.flow.queue import Entry, FlowQueue

Admission = Literal["direct", "queue", "shed"]


def admit(saturated: bool, queued: int, priority: int) -> Admission:
    """What happens to a new request of ``priority`` on a route with ``queued`` held requests."""
    if saturated:
        return "shed" if priority < 0 else "queue"
    return "queue" if queued else "direct"


class Placer(Protocol):
    """The route's replicas as the dispatcher needs them."""

    def with_room(self, now: float) -> Collection[str]:
        """Names of the eligible replicas that have room now (see :mod:`gateway.flow.saturation`)."""
        ...

    def preferred(self, entry: Entry) -> str | None:
        """Where the policy would place ``entry`` over every eligible replica, changing nothing
        (asked only with ``affinity_wait_s``)."""
        ...

    def place(self, entry: Entry, allowed: Collection[str]) -> Any | None:
        """Decide among ``allowed`` and count the request there; None: nowhere (no eligible replica)."""
        ...


@dataclass(slots=True)
class Step:
    """What one dispatch step did."""

    dispatched: list[tuple[Entry, Any]] = field(default_factory=list)  # (entry, the placer's placement)
    expired: list[Entry] = field(default_factory=list)
    unplaceable: list[Entry] = field(default_factory=list)  # the placer found no replica at all
    wake_at: float | None = None  # call again then even if no replica frees (a TTL, the affinity wait)


class Dispatcher:
    """Runs dispatch steps over one route's queue."""

    def __init__(self, queue: FlowQueue, affinity_wait_s: float = 0.0) -> None:
        self.queue = queue
        self.affinity_wait_s = affinity_wait_s

    def step(self, placer: Placer, now: float) -> Step:
        """Expire what is due, then dispatch heads while a replica has room."""
        queue = self.queue
        out = Step(expired=queue.expire(now))
        wait = self.affinity_wait_s
        while True:
            entry = queue.peek()
            if entry is None:
                break
            room = placer.with_room(now)
            if not room:
                break
            if wait > 0 and now < entry.enqueued_at + wait:  # the same sum as wake_at: no float spin
                favourite = placer.preferred(entry)
                if favourite is not None and favourite not in room:
                    out.wake_at = entry.enqueued_at + wait  # then it takes whoever has room
                    break
            placement = placer.place(entry, room)
            popped = queue.pop()
            assert popped is entry  # nothing changed the queue in between
            if placement is None:
                out.unplaceable.append(entry)
                continue
            out.dispatched.append((entry, placement))
        deadline = queue.next_deadline()
        if deadline is not None and (out.wake_at is None or deadline < out.wake_at):
            out.wake_at = deadline
        return out
