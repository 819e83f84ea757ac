"""Which held requests go now, and where: late binding over a :class:`FlowQueue` (pure).

A held request is *placed* (the route policy's decision) only when it is dispatched, so it
goes where its prefix is cached if that replica has room at that moment — not where it
would have been queued seconds earlier.  The :class:`Placer` is the route's side: which
replicas have room now, and "decide among these, and count it there" (the gateway's
``PolicyRunner.decide(exclude=the full ones)`` + ``acquire``; the benchmark's simulated
fleet).  Each placement changes the gateway's own counts, so the next ``with_room`` already
sees it: a freed replica takes as many requests as it has room for, no more.

Head of line (``lookahead: 1``).  The queue's head is the only candidate (strict priority,
then fairness).  When the head's favourite replica is full and another has room, the policy
picks among those with room, after ``affinity_wait_s`` (the queue waits behind it; the
wait runs from the first time the head was held back, not from its arrival).

Look-past (``lookahead`` W > 1, the policy benchmark's finding): measured on the virtual
clock, placing the head on whichever replica frees first loses the prefix hits at
saturation (every replica sits at its limit, and the one that frees is rarely the head's
prefix holder).  With W > 1 the dispatcher takes the first of the top band's first W
entries in fair order (any flow's: a route with one flow — no fairness header — is one
FCFS line, and looking only at flow heads looked at nothing) whose own unrestricted
decision (the policy's bounded loads included, so it spills as it would unsaturated) is a
replica with room.  When none of them is, the head waits for its own replica up to
``affinity_wait_s`` from the first time it was held back so (the others pass it
meanwhile, so the queue does not stall behind it), then takes whichever has room.  An
entry is overtaken by at most W-1 later ones per dispatch; between flows the fair order
still rules who is looked at first.

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
from gateway.routing.base import Decision

Admission = Literal["direct", "queue", "shed"]


def admit(saturated: bool, queued: int, priority: int) -> Admission:
    """What happens to a new request of ``priority`` on a route with ``queued`` held requests."""
    if saturated:
        return "shed" if priority < 0 else "queue"
    return "queue" if queued else "direct"


def favourite(decision: Decision) -> str | None:
    """The replica a queued request is worth waiting for: its policy's pick, when that pick
    holds some of its prompt (the policy matched blocks there); None when it matched none.

    Waiting for a replica pays only in prefill its cache saves.  A prompt no replica holds (a
    new conversation placed by the ring, any request of a cache-blind policy) gains nothing
    from one replica over another, so it takes the first that frees: held for its ring
    replica, a quiet tenant's new prompts waited for a slot on one replica of two (~60 ms
    more at the p90, on a flood that frees a slot every ~30 ms fleet-wide)."""
    return decision.replica if decision.detail.get("matched_blocks", 0) > 0 else None


class Placer(Protocol):
    """The route's replicas as the dispatcher needs them."""

    def with_room(self, now: float) -> Collection[str]:
        """Names of the eligible replicas that have room now (see :mod:`gateway.flow.saturation`)."""
        ...

    def preferred(self, entry: Entry) -> str | None:
        """Where the policy would place ``entry`` over every eligible replica, changing nothing
        (asked with ``lookahead`` > 1 or ``affinity_wait_s``), if that replica is worth waiting
        for (:func:`favourite`); None: any replica with room will do."""
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


def _affinity_until(entry: Entry, wait: float, now: float) -> float | None:
    """Until when ``entry`` still waits for its own replica (None: no longer).

    The wait runs from the first time the dispatcher held it back while another replica had
    room, not from its arrival: under a long queue every request reaches the head after more
    than ``affinity_wait_s`` in line, and timed from arrival each would then take whichever
    replica freed first — cache-blind, the overloaded synthetic trace's lost hit points."""
    if wait <= 0:
        return None
    if entry.passed_at is None:
        entry.passed_at = now
    until = entry.passed_at + wait
    return until if now < until else None  # the same sum as wake_at: no float spin


class Dispatcher:
    """Runs dispatch steps over one route's queue."""

    def __init__(self, queue: FlowQueue, affinity_wait_s: float = 0.0, lookahead: int = 1) -> None:
        self.queue = queue
        self.affinity_wait_s = affinity_wait_s
        self.lookahead = lookahead

    def step(self, placer: Placer, now: float) -> Step:
        """Expire what is due, then dispatch while a replica has room."""
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
            chosen, allowed = entry, room
            if self.lookahead > 1:
                # look past the head: the first flow head (fair order) whose own decision has room
                found = None
                for candidate in queue.candidates(self.lookahead):
                    favourite = placer.preferred(candidate)
                    if favourite is None or favourite in room:
                        found = candidate, (room if favourite is None else (favourite,))
                        break
                if found is not None:
                    chosen, allowed = found
                elif (until := _affinity_until(entry, wait, now)) is not None:
                    out.wake_at = until  # then the head takes whoever has room
                    break
            elif wait > 0 and (entry.passed_at is None or now < entry.passed_at + wait):
                favourite = placer.preferred(entry)
                held_back = favourite is not None and favourite not in room
                if held_back and (until := _affinity_until(entry, wait, now)) is not None:
                    out.wake_at = until
                    break
            placement = placer.place(chosen, allowed)
            queue.take(chosen)
            if placement is None:
                out.unplaceable.append(chosen)
                continue
            out.dispatched.append((chosen, placement))
        deadline = queue.next_deadline()
        if deadline is not None and (out.wake_at is None or deadline < out.wake_at):
            out.wake_at = deadline
        return out
