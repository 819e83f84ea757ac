"""Fleet-wide outlier rules: the ejection cap, panic mode and slow-replica deprioritization.

A single replica can judge its own failures (``Replica.report_*``), but three rules need the
whole fleet, so they live here:

- **Ejection cap.**  A load spike that makes every replica time out must not take the whole
  fleet out: at most ``max_ejected_percent`` of the replicas are ejected by real traffic at
  once (always at least one may be).  Active health checks are not capped — a replica whose
  ``/health`` fails is down whatever the others do.
- **Panic mode.**  When a route's healthy share falls below ``panic_threshold_percent`` the
  route picks among *all* its replicas (as Envoy does): answers that may fail beat a certain
  503 for everything, and traffic reaching a replica that is back is what brings it back
  (passive recovery) without waiting for the next active check.
- **Slow replicas.**  A replica whose smoothed time to first byte is far above the fleet's
  median is deprioritized — it gets only every ``slow_probe_every``-th request of its routes,
  so its latency keeps being measured — but never ejected: slow is not broken.

Membership is read through a callable so that replicas added or removed at run time
(discovery, reload) are covered without telling this module.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Collection, Iterable, Sequence

from gateway.config import HealthSettings
from gateway.replicas.pool import Replica

#: samples a replica needs before it can be judged slow (or serve as a reference)
TTFB_MIN_SAMPLES = 5
#: how often (seconds) the slow flags are recomputed, at most
SLOW_REFRESH_S = 0.25


class Fleet:
    """Rules that compare a replica with the others (see the module docstring)."""

    def __init__(
        self,
        members: Callable[[], Iterable[Replica]],
        health: HealthSettings,
        pools: Callable[[], Iterable[Sequence[Replica]]] | None = None,
    ) -> None:
        self._members = members
        # the routes' pools: a replica is compared with the replicas it shares traffic with
        # (a big model's pool is not "slow" next to a small model's); default: one pool of all
        self._pools = pools
        self.health = health
        self._slow_checked = 0.0
        #: called with (replica, cause) when a replica may have come back with an empty cache
        #: (see ``Replica._cold``); the gateway's warm-restart replayer sets it
        self.on_cold: Callable[[Replica, str], None] | None = None

    def adopt(self, replicas: Iterable[Replica]) -> None:
        """Point replicas at this fleet (their ejections are then capped with the others)."""
        for replica in replicas:
            replica.fleet = self

    def may_eject(self, replica: Replica, now: float) -> bool:
        """Whether ejecting ``replica`` now keeps the ejected share within the cap."""
        members = list(self._members())
        percent = self.health.max_ejected_percent
        if percent <= 0:
            return False
        cap = max(1, int(len(members) * percent / 100.0))
        ejected = sum(1 for r in members if r is not replica and r.ejected_until > now)
        return ejected + 1 <= cap

    def note_cold(self, replica: Replica, cause: str) -> None:
        """``replica`` restarted or rejoined (``cause``, see ``gateway.replicas.pool.COLD_CAUSES``)."""
        if self.on_cold is not None:
            self.on_cold(replica, cause)

    def note_ttfb(self, now: float) -> None:
        """A replica has a new latency sample: recompute the slow flags (rate-limited)."""
        if now - self._slow_checked >= SLOW_REFRESH_S:
            self._slow_checked = now
            members = list(self._members())
            pools = [list(p) for p in self._pools()] if self._pools is not None else [members]
            refresh_slow(members, pools, self.health)


def refresh_slow(replicas: Sequence[Replica], pools: Sequence[Sequence[Replica]], health: HealthSettings) -> None:
    """Flag replicas whose smoothed time to first byte is far above the others' median.

    Judged in every pool the replica is in (against that pool's other measured replicas): slow
    only where every pool with a reference says so.

    **Queueing is not slowness.**  Where the gateway knows the prefill queued ahead of each
    request (a route with prompt estimates: every sample then comes with its work), the
    factor applies to time per token of that work — a replica answering late because the
    gateway sent it more (a conversation's home at saturation, a hot prefix's holder) is not
    slow, one that prefills at a third of the others' speed is.  Judged on raw time to first
    byte, the busiest holders of cached prefixes were deprioritized under load and their
    caches bypassed (Mooncake synthetic trace at saturation: 0.8 points of hit rate, and the
    run-to-run spread).  ``slow_min_extra_s`` still applies to the raw times (noise guard).
    """
    factor = health.slow_ttft_factor

    def measured(r: Replica) -> bool:
        return r.ttfb_samples >= TTFB_MIN_SAMPLES and r.ttfb_ewma is not None

    def per_work(r: Replica) -> bool:
        return r.ttfb_work_samples >= TTFB_MIN_SAMPLES and r.ttfb_per_work_ewma is not None

    for replica in replicas:
        verdicts = []
        if factor > 0 and measured(replica):
            own = replica.ttfb_ewma or 0.0
            for pool in pools:
                if replica not in pool:
                    continue
                peers = [r for r in pool if r is not replica and measured(r)]
                if not peers:
                    continue
                median = statistics.median(r.ttfb_ewma or 0.0 for r in peers)
                far = own - median >= health.slow_min_extra_s
                if per_work(replica) and all(map(per_work, peers)):
                    typical = statistics.median(r.ttfb_per_work_ewma or 0.0 for r in peers)
                    verdicts.append(far and (replica.ttfb_per_work_ewma or 0.0) > factor * typical)
                else:
                    verdicts.append(far and own > factor * median)
        slow = bool(verdicts) and all(verdicts)
        if slow != replica.slow:
            replica.set_slow(slow)


def select_eligible(
    replicas: Sequence[Replica], exclude: Collection[str] = (), *, dry_run: bool = False
) -> tuple[list[Replica], bool]:
    """The replicas a route may pick from now, and whether the route is in panic mode.

    Healthy ones not yet tried; in panic mode every one not yet tried (a retry prefers a
    healthy one).  Slow replicas are left out while a faster one is eligible, except that
    every ``slow_probe_every``-th request offered to a slow replica goes to it alone
    (``dry_run`` advances no such turn).  A runner keeps the answer for ``exclude=()``
    between health events instead (:class:`EligibleSet`).
    """
    pool, panic = _healthy_or_panic(replicas, exclude)
    return EligibleSet.split(pool).pick(dry_run), panic


def _healthy_or_panic(replicas: Sequence[Replica], exclude: Collection[str]) -> tuple[list[Replica], bool]:
    """The replicas not yet tried that may serve (health and panic mode only), and the panic flag."""
    if not replicas:
        return [], False
    health = replicas[0].health_settings
    healthy = sum(1 for r in replicas if r.healthy)
    threshold = health.panic_threshold_percent
    panic = threshold > 0 and healthy * 100.0 < threshold * len(replicas)
    if panic:
        pool = [r for r in replicas if r.name not in exclude]
        if exclude:
            preferred = [r for r in pool if r.healthy]
            if preferred:
                pool = preferred
    else:
        pool = [r for r in replicas if r.healthy and r.name not in exclude]
    return pool, panic


class EligibleSet:
    """:func:`select_eligible` for a route's first attempt, computed once per health event.

    Who is eligible changes only when a replica's health or slow flag (or the pool) changes;
    the runner builds one of these then and reuses it for every request until the next
    change, so a decision does not pass over the whole pool.  Per request only the slow
    replicas' probe turns advance (:meth:`pick`).
    """

    __slots__ = ("panic", "slow", "stable")

    def __init__(self, replicas: Sequence[Replica]) -> None:
        pool, self.panic = _healthy_or_panic(replicas, ())
        split = self.split(pool)
        self.slow, self.stable = split.slow, split.stable

    @classmethod
    def split(cls, pool: list[Replica]) -> EligibleSet:
        """``pool`` split into the replicas that serve (``stable``) and the slow ones that
        are only probed now and then (empty unless a faster one is eligible)."""
        self = cls.__new__(cls)
        self.panic = False
        self.slow = [r for r in pool if r.slow] if len(pool) > 1 else []
        fast = [r for r in pool if not r.slow] if self.slow else pool
        if not fast:  # all slow: they all serve, and none is probed apart
            self.slow, fast = [], pool
        self.stable = fast
        return self

    def pick(self, dry_run: bool = False) -> list[Replica]:
        """The replicas this request may go to: :attr:`stable` (the same list object every
        time), or one slow replica alone on its probe turn (``dry_run`` advances no turn)."""
        # On its turn a slow replica gets the request outright: a probe that keeps its
        # latency measured (so it can stop being slow), whatever the policy would prefer.
        probe = None
        for r in self.slow:
            if r.slow_turn(dry_run) and probe is None:
                probe = r
        return [probe] if probe is not None else self.stable
