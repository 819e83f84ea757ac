"""Snapshot catch-up: a gateway process that joins learns recent affinity from its peers.

Shared affinity (``gateway.state.affinity_sync``) only carries *new* records, so a pod that
starts (a scale-up, a rollout, a restart) would route blind until traffic taught it, and
send conversations away from the replicas that hold their history.  Instead, when a peer
hears a process it does not know yet (its first load report: ``state.share_load``, sent only
once that process has subscribed), it re-publishes the most recent part of its affinity
indexes on the shared channel, then an end mark.  Every process applies those records like any
other (for the ones that had them already, they only refresh recency).

The newcomer answers ``/ready`` with 503 until it has heard a snapshot end (``readiness``): a
Service then sends it traffic only once it routes like its peers.  It does not wait when it
is alone (no peer's load report within ``ALONE_S`` of subscribing), and never longer than
``ready_wait_s`` (Redis away, or peers of an older version that send no end mark).

Bounded: at most ``keys_total`` keys per snapshot, spread over the replicas, and at most
one snapshot per ``min_interval_s`` (a rollout starting many pods at once gets one; a pod
joining within the interval gets the next one at its end, not none; an empty index sends
only its end mark and does not count).
The snapshot keeps each key's "end of a prompt" mark and length (``AffinityIndex`` extents)
and the recency order; it reads the index's own LRU (no second copy of the state).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from gateway.routing.affinity import AffinityIndex
from gateway.state.wire import MAX_DEMAND_HEADS, MAX_VARYING_PLACES, Record

log = logging.getLogger("prefix_gateway.state")


def snapshot_records(indexes: Mapping[str, AffinityIndex], keys_total: int) -> list[Record]:
    """The most recent keys of every replica of every index, as records that rebuild them in order.

    A record is one prompt end (a key with an extent) followed by the keys recorded after it
    up to the next end: ``record_stored`` marks a record's first key as an end and appends the
    rest in order, so replaying the records oldest first restores both marks and recency.
    Keys older than a replica's oldest end in the window are left out.  Each record carries
    what its keys weigh in a modelled KV cache, so the newcomer's model fills as this one's.
    """
    lrus: list[tuple[str, str, Any, AffinityIndex]] = []
    for route, index in indexes.items():
        for name, lru in getattr(index, "_lru", {}).items():  # the index's own LRU, oldest first
            if lru:
                lrus.append((route, name, lru, index))
    if not lrus or keys_total <= 0:
        return []
    per_replica = max(1, keys_total // len(lrus))
    records: list[Record] = []
    for route, name, lru, index in lrus:
        runs: list[tuple[list[int], int | None]] = []  # (keys, extent) per prompt end, oldest first
        for key, mark in list(lru.items())[-per_replica:]:
            if mark is not None:  # a prompt ends here: a new record starts
                runs.append(([key], mark or None))
            elif runs:
                runs[-1][0].append(key)
        records.extend(Record(route, name, keys, extent, index.held_weights(name, keys)) for keys, extent in runs)
    return records


# Peers publish their load at least every second (``affinity_sync._LOAD_HEARTBEAT_S``): a process
# that has heard none this long after subscribing is alone and has nobody to wait for.
ALONE_S = 1.5


class CatchUp:
    """Sends a snapshot to the shared channel when a new peer appears, and says when this process,
    itself new, has had one (see the module docstring)."""

    def __init__(
        self,
        sync: Any,
        keys_total: int = 16_384,
        min_interval_s: float = 5.0,
        delay_s: float = 0.2,
        ready_wait_s: float = 8.0,
    ) -> None:
        self.sync = sync  # an AffinitySync: its indexes, its publish queue, its subscription and stats
        self.keys_total = keys_total
        self.min_interval_s = min_interval_s
        self.delay_s = delay_s  # a short pause lets a rollout's pods appearing together share one send
        self.ready_wait_s = ready_wait_s
        self.sent = 0  # snapshots sent
        self.records = 0  # records in them
        self._last = float("-inf")
        self._scheduled = False
        self._started_at: float | None = None
        self._done: str | None = None  # why this process no longer waits (once decided, for good)

    def start(self, now: float) -> None:
        """The process starts sharing state: the wait for a snapshot is counted from here."""
        self._started_at = now

    def readiness(self, now: float) -> tuple[bool, str]:
        """``(ready, why)`` for ``/ready``: has this process caught up with its peers (or need not)?"""
        if self._done is not None:
            return True, self._done
        if self._started_at is None or self.ready_wait_s <= 0:
            return True, "not waiting"
        subscribed = self.sync.subscribed_at
        if self.sync.stats.snapshots_heard:
            self._done = "snapshot received"
        elif subscribed is not None and not self.sync.stats.peers and now - subscribed >= ALONE_S:
            self._done = "no peers"
        elif now - self._started_at >= self.ready_wait_s:
            self._done = "gave up waiting"
            log.warning(
                "affinity sync: no catch-up snapshot within %.0f s (%s); serving on what this process knows",
                self.ready_wait_s,
                "Redis not reached" if subscribed is None else f"{self.sync.stats.peers} peers",
            )
        else:
            return False, "waiting for the peers' catch-up snapshot"
        log.info("affinity sync: ready (%s)", self._done)
        return True, self._done

    def new_peer(self, pod: str) -> None:
        """A process this one did not know reported its load: offer it a snapshot, soon.

        Within ``min_interval_s`` of the last snapshot the send is deferred to the end of the
        interval, not dropped: pods of a rollout a few seconds apart all get one (a pending
        send serves every newcomer: snapshots go to the shared channel).
        """
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._scheduled = True
        wait = max(self.delay_s, self._last + self.min_interval_s - time.monotonic())
        loop.call_later(wait, self._send, pod)

    def _send(self, pod: str) -> None:
        self._scheduled = False
        records = snapshot_records(self.sync.indexes, self.keys_total)
        demand = {route: d.export(MAX_DEMAND_HEADS) for route, d in self.sync.demands.items()}
        varies = [
            (route, place, 0)
            for route, learner in self.sync.learners.items()
            for place in learner.varying_digests(MAX_VARYING_PLACES)
        ]
        # empty, it is only the end mark (start counts, varying places): the newcomer has nothing to wait for
        self.sync.offer(records, {route: e for route, e in demand.items() if e[1]}, varies)
        if not records:  # nothing learned yet (peers meeting at startup): does not count
            return
        self._last = time.monotonic()
        self.sent += 1
        self.records += len(records)
        log.info("affinity sync: new peer %s; sent a snapshot of %d records", pod, len(records))
