"""Snapshot catch-up: a gateway process that joins learns recent affinity from its peers.

Shared affinity (``gateway.state.affinity_sync``) only carries *new* records, so a pod that
starts (a scale-up, a rollout, a restart) would route blind until traffic taught it, and
send conversations away from the replicas that hold their history.  Instead, when a peer
hears a process it does not know yet (its first load report: ``state.share_load``), it
re-publishes the most recent part of its affinity indexes on the shared channel, a second
later (so the newcomer has subscribed).  Every process applies those records like any other
(for the ones that had them already, they only refresh recency).

Bounded: at most ``keys_total`` keys per snapshot, spread over the replicas, and at most
one snapshot per ``min_interval_s`` (a rollout starting many pods at once gets one; a pod
joining within the interval gets the next one at its end, not none; an empty index sends
nothing and does not count).
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

log = logging.getLogger("prefix_gateway.state")

Record = tuple[str, str, list[int], int | None]  # route, replica, keys (deepest first), prompt tokens


def snapshot_records(indexes: Mapping[str, AffinityIndex], keys_total: int) -> list[Record]:
    """The most recent keys of every replica of every index, as records that rebuild them in order.

    A record is one prompt end (a key with an extent) followed by the keys recorded after it
    up to the next end: ``record_stored`` marks a record's first key as an end and appends the
    rest in order, so replaying the records oldest first restores both marks and recency.
    Keys older than a replica's oldest end in the window are left out.
    """
    lrus: list[tuple[str, str, Any]] = []
    for route, index in indexes.items():
        for name, lru in getattr(index, "_lru", {}).items():  # the index's own LRU, oldest first
            if lru:
                lrus.append((route, name, lru))
    if not lrus or keys_total <= 0:
        return []
    per_replica = max(1, keys_total // len(lrus))
    records: list[Record] = []
    for route, name, lru in lrus:
        items = list(lru.items())[-per_replica:]
        current: list[int] | None = None
        extent: int | None = None
        for key, mark in items:
            if mark is not None:  # a prompt ends here: a new record starts
                if current:
                    records.append((route, name, current, extent))
                current, extent = [key], mark or None
            elif current is not None:
                current.append(key)
        if current:
            records.append((route, name, current, extent))
    return records


class CatchUp:
    """Sends a snapshot to the shared channel when a new peer appears (see the module docstring)."""

    def __init__(self, sync: Any, keys_total: int = 16_384, min_interval_s: float = 5.0, delay_s: float = 1.0) -> None:
        self.sync = sync  # an AffinitySync: its indexes and its publish queue
        self.keys_total = keys_total
        self.min_interval_s = min_interval_s
        self.delay_s = delay_s
        self.sent = 0  # snapshots sent
        self.records = 0  # records in them
        self._last = float("-inf")
        self._scheduled = False

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
        if not records:  # nothing learned yet (peers meeting at startup): not a snapshot
            return
        self._last = time.monotonic()
        self.sync.offer(records)
        self.sent += 1
        self.records += len(records)
        log.info("affinity sync: new peer %s; sent a snapshot of %d records", pod, len(records))
