"""One replica's failure-rate window: the passive-health input that looks back in time.

The replica (:mod:`gateway.replicas.pool`) feeds it and the fleet rules
(:mod:`gateway.replicas.outlier`) read its rate through the replica; a module of its own keeps
the window's bookkeeping out of both.
"""

from __future__ import annotations

from collections import deque

#: bound on one replica's failure-rate window, whatever the request rate
WINDOW_MAX_EVENTS = 4096


class FailureWindow:
    """Outcomes of real requests over the last ``window_s`` seconds (bounded)."""

    __slots__ = ("_events", "failed", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, bool]] = deque()
        self.failed = 0

    def add(self, failed: bool, now: float) -> None:
        events = self._events
        events.append((now, failed))
        self.failed += failed
        horizon = now - self.window_s
        while events and (events[0][0] < horizon or len(events) > WINDOW_MAX_EVENTS):
            self.failed -= events.popleft()[1]

    @property
    def total(self) -> int:
        return len(self._events)

    def rate(self) -> float:
        return self.failed / len(self._events) if self._events else 0.0

    def clear(self) -> None:
        self._events.clear()
        self.failed = 0
