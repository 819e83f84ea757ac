"""Runs one route's policy under the rules every policy shares.

The runner — not each policy — skips unhealthy (or already tried) replicas, builds the
``ReplicaView``s with in-flight counts taken at decision time, checks the policy's answer,
counts the request in flight on the chosen replica, and after the response feeds the
outcome back through ``policy.observe``.  Policies stay pure functions of their inputs.

``decide(..., dry_run=True)`` answers "where would this go now?" for ``/admin/explain``
without changing anything: it asks the policy's ``peek`` instead of ``choose``, so
round-robin credits, tie-break turns, random generators and the affinity index do not
advance.  ``set_replicas`` is the one way pool membership changes: the runner and the
policy's ``set_members`` stay in step.

Nothing here passes over the whole pool per request.  The runner watches its replicas
(``Replica.watch``): a health or slow-flag change drops the cached eligible set (rebuilt at
the next decision, :class:`~gateway.replicas.outlier.EligibleSet`), and every in-flight or
queued-prefill change updates the eligible replicas' :class:`~gateway.routing.load.FleetLoad`,
which the views handed to the policy carry (``views.load``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from gateway.errors import NoHealthyReplica
from gateway.replicas.outlier import EligibleSet, select_eligible
from gateway.replicas.pool import Replica
from gateway.routing.base import Decision, Policy, ReplicaView, RequestView
from gateway.routing.load import FleetLoad, FleetViews
from gateway.routing.policies.least_loaded import least_loaded

log = logging.getLogger("prefix_gateway.routing")


class LiveReplicaView:
    """A :class:`ReplicaView` that reads its replica's counters when asked (no copy per request).

    Same attributes and meaning as ``Replica.view()``: in-flight and queued prefill include
    the peers' shares; engine stats come from the last scrape.
    """

    __slots__ = ("name", "replica", "weight")

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.name = replica.name
        self.weight = replica.weight

    @property
    def in_flight(self) -> int:
        r = self.replica
        return r.in_flight + r.peer_in_flight

    @property
    def pending_prefill_tokens(self) -> int:
        r = self.replica
        return r.pending_prefill_tokens + r.peer_pending_prefill_tokens

    @property
    def kv_cache_usage(self) -> float | None:
        engine = self.replica.engine
        return None if engine is None else engine.kv_cache_usage

    @property
    def num_waiting(self) -> float | None:
        engine = self.replica.engine
        return None if engine is None else engine.waiting

    @property
    def kv_cache_tokens(self) -> int | None:
        engine = self.replica.engine
        return None if engine is None else engine.kv_cache_tokens

    @property
    def block_size(self) -> int | None:
        return self.replica.block_size

    @property
    def pending_prefill_by_flow(self) -> dict[str, int]:
        return self.replica.pending_prefill_by_flow


@dataclass(frozen=True, slots=True)
class FirstAttempt:
    """Who a request's first attempt may go to, kept from one health event to the next."""

    eligible: EligibleSet
    views: FleetViews  # views of ``eligible.stable``, carrying their live load
    slots: dict[int, int]  # id(replica) -> its slot in ``views.load``


class PolicyRunner:
    """One route's policy bound to its pool of replicas."""

    def __init__(self, route: str, policy_name: str, policy: Policy, replicas: Sequence[Replica]) -> None:
        self.route = route
        self.policy_name = policy_name
        self.policy = policy
        self.replicas = list(replicas)
        self._by_name = {r.name: r for r in self.replicas}
        self._turn = 0
        self._warned_invalid = False
        self.panic_decisions = 0  # decisions made over all replicas (healthy share below the panic threshold)
        self._views: dict[str, LiveReplicaView] = {}
        self._all_views: tuple[LiveReplicaView, ...] | None = None
        self._first: FirstAttempt | None = None
        for r in self.replicas:
            r.watch(self)

    # -- what the replicas tell us (gateway.replicas.pool.ReplicaWatcher) ----------------
    def load_changed(self, replica: Replica, in_flight: int, pending: int) -> None:
        first = self._first
        if first is not None:
            slot = first.slots.get(id(replica))
            if slot is not None:
                first.views.load.add(slot, in_flight, pending)

    def state_changed(self, replica: Replica) -> None:
        self._first = None  # who is eligible may have changed: rebuilt at the next decision

    def capacity_changed(self, replica: Replica) -> None:
        # rare (a replica's first scrape, a restart with another KV size): the policy may
        # model each replica's prefix cache (prefix: replica_cache_tokens: auto)
        self.policy.set_members(self.members())

    def _first_attempt(self) -> FirstAttempt:
        """The cached eligible set for a first attempt, with its views and live load (O(n)
        to rebuild, once per health event)."""
        first = self._first
        if first is None:
            eligible = EligibleSet(self.replicas)
            stable = eligible.stable
            load = FleetLoad(
                [r.name for r in stable],
                [r.weight for r in stable],
                [r.in_flight + r.peer_in_flight for r in stable],
                [r.pending_prefill_tokens + r.peer_pending_prefill_tokens for r in stable],
            )
            views = FleetViews(self._live_views(stable), load)
            first = self._first = FirstAttempt(eligible, views, {id(r): i for i, r in enumerate(stable)})
        return first

    def _live_views(self, eligible: list[Replica]) -> Sequence[ReplicaView]:
        """Views that read each replica's counters when the policy reads them.

        Building a frozen ``ReplicaView`` per replica per request costs ~1 µs each (0.27 ms at
        256 replicas, most of the route stage).  The policy runs synchronously on the event
        loop, so counters cannot change while it decides: a live view reads the same numbers
        a snapshot would, and is built once per replica.
        """
        if len(eligible) == len(self.replicas) and self._all_views is not None:
            return self._all_views  # every replica eligible (the common case): one list, reused
        cache = self._views
        out = []
        for r in eligible:
            view = cache.get(r.name)
            if view is None or view.replica is not r:
                view = cache[r.name] = LiveReplicaView(r)
            out.append(view)
        views = tuple(out)  # immutable: the cached one is shared by every request
        if len(eligible) == len(self.replicas):
            self._all_views = views
        return views  # type: ignore[return-value]  # the same attributes as ReplicaView

    def set_replicas(self, replicas: Sequence[Replica]) -> None:
        """The pool's membership changed (reload, discovery): tell the policy too.

        Today the pool is fixed at build time, where the policy factory already receives
        every member; this keeps both in step for any future path that changes it.
        """
        for r in self.replicas:
            r.unwatch(self)
        self.replicas = list(replicas)
        self._by_name = {r.name: r for r in self.replicas}
        self._all_views = None
        self._first = None
        for r in self.replicas:
            r.watch(self)
        self.policy.set_members(self.members())

    def members(self) -> list[ReplicaView]:
        """Every configured replica (healthy or not): what hash-based policies build rings from."""
        return [r.view() for r in self.replicas]

    def eligible(self) -> list[Replica]:
        """The replicas a first attempt may go to now (flow control's saturation check reads
        their load; kept between health events, so no pass over the pool)."""
        eligible = self._first_attempt().eligible
        return eligible.stable if not eligible.slow else [*eligible.stable, *eligible.slow]

    def healthy_count(self) -> int:
        return sum(1 for r in self.replicas if r.healthy)

    def in_panic(self) -> bool:
        """Whether decisions now go over all replicas (see gateway.replicas.outlier)."""
        return self._first_attempt().eligible.panic

    def decide(
        self, request: RequestView, exclude: Collection[str] = (), *, dry_run: bool = False
    ) -> tuple[Decision, Replica]:
        """Pick a replica for ``request`` among healthy ones not in ``exclude``.

        Below the panic threshold, among all not in ``exclude``; slow ones only now and then.

        Raises :class:`NoHealthyReplica` (503) when none is left.  ``dry_run``: decide
        without advancing or teaching the policy (see the module docstring).
        """
        # health, panic mode and slow replicas: gateway.replicas.outlier
        first = None
        if exclude:  # a retry: worked out afresh (O(n), rare)
            eligible, panic = select_eligible(self.replicas, exclude, dry_run=dry_run)
        else:  # kept between health events; only slow replicas' probe turns advance here
            first = self._first_attempt()
            eligible, panic = first.eligible.pick(dry_run), first.eligible.panic
            if eligible is not first.eligible.stable:
                first = None  # a slow replica's probe turn: it alone
        if panic and eligible and not dry_run:
            self.panic_decisions += 1
        if not eligible:
            healthy = self.healthy_count()
            if exclude and healthy:
                msg = f"no other healthy replica left for route {self.route!r} after {len(exclude)} failed attempt(s)"
            else:
                msg = f"no healthy replica for route {self.route!r} ({healthy} of {len(self.replicas)} healthy)"
            error = NoHealthyReplica(msg)
            error.route = self.route
            raise error
        views = first.views if first is not None else self._live_views(eligible)
        decision = (self.policy.peek if dry_run else self.policy.choose)(request, views)
        replica = self._by_name.get(decision.replica)
        if replica is None or (id(replica) not in first.slots if first is not None else replica not in eligible):
            # A policy bug must not fail the request: fall back and say so (once) in the log.
            if not self._warned_invalid:
                log.error("policy %s returned ineligible replica %r; using least loaded", self.policy_name, decision)
                self._warned_invalid = True
            turn = self._turn + 1
            if not dry_run:
                self._turn = turn
            pick = least_loaded(views, turn)
            decision = Decision(pick.name, "fallback", {"invalid_choice": decision.replica})
            replica = self._by_name[pick.name]
        return decision, replica

    @staticmethod
    def acquire(replica: Replica, request: RequestView, decision: Decision) -> int:
        """Count the request in flight on ``replica`` and charge its uncached prefill work.

        Returns the prompt tokens charged to ``replica.pending_prefill_tokens`` (the prompt
        minus what the policy predicted cached there; 0 when the route computes no prompt
        estimate): the caller hands exactly that back to :meth:`prefill_done` at the first
        byte of the answer, or when the attempt ends without one.
        """
        replica.in_flight += 1
        total = request.prompt_tokens_estimate
        if not total:
            return 0
        uncached = max(0, total - int(decision.detail.get("predicted_cached_tokens") or 0))
        return replica.charge_prefill(uncached, request.flow)

    @staticmethod
    def prefill_done(replica: Replica, charged: int) -> None:
        """The request's prefill is no longer queued on ``replica`` (answered, ended, or never sent)."""
        replica.discharge_prefill(charged)

    @staticmethod
    def answered(replica: Replica, charged: int) -> None:
        """The replica answered (first byte) or the attempt ended: call once per attempt.

        Its prefill is no longer queued, and the replica's engine has moved on by one request
        (``Replica.waiting_now``, which flow control reads between scrapes)."""
        PolicyRunner.prefill_done(replica, charged)
        replica.answered()

    def release(
        self,
        replica: Replica,
        request: RequestView,
        decision: Decision,
        cached_tokens: int | None,
        completed: bool,
        served: bool = True,
    ) -> None:
        """The request left ``replica``; a completed one teaches the policy (e.g. affinity).

        ``served=False``: the replica did not serve the prompt — no 2xx answer (it refused it
        with a 4xx, answered 5xx, failed, or the client left before its first byte): a policy
        with ``forget_attempt`` takes back what it recorded at decision time, so neither this
        process nor its peers believe the replica holds a prompt it never computed.
        """
        replica.in_flight -= 1
        if not served:
            forget = getattr(self.policy, "forget_attempt", None)
            if forget is not None:
                try:
                    forget(request, decision)
                except Exception:  # a policy bug must not fail the request
                    log.exception("policy %s forget_attempt() failed", self.policy_name)
        if completed:
            try:
                self.policy.observe(request, decision, cached_tokens)
            except Exception:  # a policy bug must not fail a finished request
                log.exception("policy %s observe() failed", self.policy_name)
