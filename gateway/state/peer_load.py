"""Load that other gateway processes put on the shared replicas.

Every gateway counts in-flight requests and queued prefill tokens per replica for the requests
*it* sent (``Replica.in_flight``, ``Replica.pending_prefill_tokens``).  With several gateway
pods, each one alone sees a fraction of the load, so its load bound and its "least busy"
choice are blind to the rest.  With shared state, each pod publishes its own counts every
``load_interval_ms`` (and at least every second) and adds its peers' latest counts to what
its policies see (``ReplicaView``): the bound applies to the fleet's load as this pod knows it.

A peer's report is at most one interval old when it arrives, so a burst within an interval
is invisible to the other pods; a report older than ``ttl_s`` (a pod that died, or a Redis
outage) is dropped, and the pod falls back to its own counts.  Only the local counts are
published, never the sums, so nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gateway.replicas.pool import Replica

Report = dict[str, tuple[int, int]]  # replica -> (in_flight, pending_prefill_tokens)
MAX_REPLICAS_PER_REPORT = 4096


class PeerLoad:
    """This process's load report, and its peers' reports applied to the local replicas."""

    def __init__(self, replicas: Mapping[str, Replica], ttl_s: float = 3.0) -> None:
        self._replicas = replicas  # the live mapping: discovery and config reloads change it
        self.ttl_s = ttl_s
        self._peers: dict[str, tuple[float, Report]] = {}  # pod -> (received at, report)
        # called with a pod's id when its first report arrives (gateway.state.catchup)
        self.on_new_peer: Callable[[str], None] | None = None

    def local_report(self) -> Report:
        return {name: (r.in_flight, r.pending_prefill_tokens) for name, r in self._replicas.items()}

    def apply(self, pod: str, report: Report, now: float) -> None:
        new = pod not in self._peers
        self._peers[pod] = (now, report)
        self._recompute()
        if new and self.on_new_peer is not None:
            self.on_new_peer(pod)

    def expire(self, now: float) -> None:
        stale = [pod for pod, (at, _) in self._peers.items() if now - at > self.ttl_s]
        for pod in stale:
            del self._peers[pod]
        if stale:
            self._recompute()

    def forget_all(self) -> None:
        self._peers.clear()
        self._recompute()

    @property
    def peers(self) -> int:
        return len(self._peers)

    def _recompute(self) -> None:
        in_flight = dict.fromkeys(self._replicas, 0)
        pending = dict.fromkeys(self._replicas, 0)
        for _, report in self._peers.values():
            for name, (flight, prefill) in report.items():
                if name in in_flight:  # a replica this process does not have: not ours to count
                    in_flight[name] += flight
                    pending[name] += prefill
        for name, replica in self._replicas.items():
            replica.peer_in_flight = in_flight[name]
            replica.peer_pending_prefill_tokens = pending[name]


def load_rows(report: Report) -> dict[str, list[int]]:
    """A report as JSON-ready rows."""
    return {name: [flight, prefill] for name, (flight, prefill) in report.items()}


def parse_load(rows: Any) -> Report:
    """A peer's report from its JSON rows; ``ValueError`` if malformed."""
    if not isinstance(rows, dict) or len(rows) > MAX_REPLICAS_PER_REPORT:
        raise ValueError("load must be an object of at most 4096 replicas")
    report: Report = {}
    for name, row in rows.items():
        if not (isinstance(row, list) and len(row) == 2 and all(type(v) is int and 0 <= v < 2**53 for v in row)):
            raise ValueError("a load row must be [in_flight, pending_prefill_tokens], ints >= 0")
        report[name] = (row[0], row[1])
    return report
