"""Process-wide caps on the proxied path: requests in flight and request-body bytes held.

``server.max_body_bytes`` and the header/body timeouts bound *one* request; nothing bounded
a thousand of them at once, and each may hold a 10 MiB body (plus its parsed JSON and a
rewritten copy) for as long as its upload and its answer last.  So every proxied request
takes a **slot** when it starts and **reserves** its body's bytes as they arrive — the
declared ``Content-Length`` up front (a body that will not fit is refused before a byte of
it is read), a chunked body as it grows — and gives both back when it finishes, however it
finishes (answered, failed, shed, client gone, body timed out): the handler's ``finally``
does it, and both releases are idempotent, so a reservation cannot leak.

Beyond a cap the request is shed: ``503 server_overloaded`` with ``retry-after``
(:class:`~gateway.errors.Overloaded`).  Only ``/v1/*`` proxied requests are counted:
``/health``, ``/ready``, ``/metrics`` and ``/admin/*`` stay reachable when the proxy path
is full.  Caps are per process (each ``--workers`` process has its own) and are read per
request, so a reload changes them live (``SERVER_LIVE`` in ``gateway.service``); requests
already admitted keep what they hold when a reload lowers a cap.

Single event loop, no awaits inside: plain integers, no locks.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import Overloaded

#: what a shed client is told to wait: sheds clear as fast as requests finish
RETRY_AFTER_S = 1.0


class Capacity:
    """The counters behind both caps, and what ``/admin/stats`` and ``/metrics`` show of them."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.buffered_bytes = 0
        self.peak_in_flight = 0
        self.peak_buffered_bytes = 0
        self.shed = {"concurrency": 0, "body_bytes": 0}

    def enter(self, limit: int) -> Slot:
        """A slot for one request, or :class:`Overloaded` when ``limit`` are in flight."""
        if self.in_flight >= limit:
            self.shed["concurrency"] += 1
            raise Overloaded(
                f"the gateway is at its limit of {limit} requests in flight; retry shortly",
                what="concurrency",
                retry_after_s=RETRY_AFTER_S,
            )
        self.in_flight += 1
        if self.in_flight > self.peak_in_flight:
            self.peak_in_flight = self.in_flight
        return Slot(self)

    def reservation(self, limit: int) -> BodyReservation:
        """An empty reservation against ``limit`` bytes in total (grown by ``reserve``)."""
        return BodyReservation(self, limit)

    def snapshot(self, max_concurrency: int, max_buffered_body_bytes: int) -> dict[str, Any]:
        return {
            "in_flight": self.in_flight,
            "max_concurrency": max_concurrency,
            "peak_in_flight": self.peak_in_flight,
            "buffered_body_bytes": self.buffered_bytes,
            "max_buffered_body_bytes": max_buffered_body_bytes,
            "peak_buffered_body_bytes": self.peak_buffered_bytes,
            "shed": dict(self.shed),
        }


class Slot:
    """One request's place among ``max_concurrency``; ``release`` more than once is harmless."""

    __slots__ = ("_capacity",)

    def __init__(self, capacity: Capacity) -> None:
        self._capacity: Capacity | None = capacity

    def release(self) -> None:
        if self._capacity is not None:
            self._capacity.in_flight -= 1
            self._capacity = None


class BodyReservation:
    """The body bytes one request holds against ``max_buffered_body_bytes``.

    ``reserve(total)`` raises the hold to ``total`` bytes (never lowers it) or refuses with
    :class:`Overloaded`, leaving the hold as it was; ``release`` gives all of it back.
    """

    __slots__ = ("_capacity", "_limit", "held")

    def __init__(self, capacity: Capacity, limit: int) -> None:
        self._capacity: Capacity | None = capacity
        self._limit = limit
        self.held = 0

    def reserve(self, total: int) -> None:
        capacity = self._capacity
        extra = total - self.held
        if capacity is None or extra <= 0:
            return
        if capacity.buffered_bytes + extra > self._limit:
            capacity.shed["body_bytes"] += 1
            raise Overloaded(
                f"the gateway holds its limit of {self._limit} bytes of request bodies; retry shortly",
                what="body_bytes",
                retry_after_s=RETRY_AFTER_S,
            )
        capacity.buffered_bytes += extra
        self.held = total
        if capacity.buffered_bytes > capacity.peak_buffered_bytes:
            capacity.peak_buffered_bytes = capacity.buffered_bytes

    def release(self) -> None:
        capacity = self._capacity
        if capacity is not None:
            capacity.buffered_bytes -= self.held
            self.held = 0
            self._capacity = None
