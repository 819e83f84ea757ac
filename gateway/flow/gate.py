"""Flow control on the event loop: the proxy's (and the endpoint picker's) side of the pure core.

:class:`FlowControl` keeps one :class:`RouteFlow` per route name (so held requests survive
a config reload that rebuilds the route).  The request path asks :meth:`RouteFlow.clear`
first — nothing queued and some eligible replica has room: decide at once, the path it
took before flow control existed (a clock read and, in the common case, one replica's
counters).  Otherwise :meth:`RouteFlow.wait` classifies the request, sheds it (negative
priority) or queues it, and returns its placement when the dispatcher lets it go.

Dispatch steps run when something may have made room: a replica's in-flight count or
queued prefill went down (the runner's ``prefill_done`` at the first byte, ``release`` at
the end — heard through ``Replica.watch`` while anything is queued), a health change, an
arrival, a TTL or affinity deadline, and every :data:`RECHECK_S` while anything is queued
(the scraped numbers change with no event).  A step runs from ``call_soon``, never inside
the runner's bookkeeping that triggered it.

Placement is :meth:`Gateway.decide` among the replicas with room, and the request is
counted there at once (``PolicyRunner.acquire``) so the next placement of the same step sees
it; the proxy's first attempt then takes that charge over instead of acquiring again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.errors import GatewayError, NoHealthyReplica, Overloaded, RateLimited
from gateway.flow.classify import Classified, classify
from gateway.flow.dispatch import Dispatcher, admit, favourite
from gateway.flow.metrics import FlowLabels, FlowMetrics
from gateway.flow.queue import Entry, FlowQueue, QueueFull
from gateway.flow.saturation import room, saturated
from gateway.flow.settings import FlowControlSettings, SaturationSettings
from gateway.replicas.pool import Replica
from gateway.routing.plan import Draft, Plan, decide
from gateway.routing.routes import Route
from gateway.routing.runner import LiveReplicaView, PolicyRunner

log = logging.getLogger("prefix_gateway.flow")

#: while anything is queued, a dispatch step at least this often (scraped numbers, staleness)
RECHECK_S = 0.05


class ReplicaSignals(LiveReplicaView):
    """A replica's load as :mod:`gateway.flow.saturation` reads it: the runner's live view
    (in flight and queued prefill, ours and the peers'; KV usage) plus the scrape's age."""

    __slots__ = ()

    @property
    def head_prefill_tokens(self) -> int:
        return self.replica.head_prefill_tokens

    @property
    def waiting(self) -> float | None:
        return self.replica.waiting_now  # the scrape's queue less what was answered since

    @property
    def running(self) -> float | None:
        engine = self.replica.engine
        return None if engine is None else engine.running

    @property
    def scraped_at(self) -> float | None:
        engine = self.replica.engine
        return None if engine is None else engine.scraped_at


def route_room(replicas: Sequence[Replica], limits: SaturationSettings, now: float) -> dict[str, str | None]:
    """Why each of a route's eligible ``replicas`` has no room now, by name (None: it has room;
    see :func:`gateway.flow.saturation.room`)."""
    reasons = room([ReplicaSignals(r) for r in replicas], limits, now)
    return {r.name: why for r, why in zip(replicas, reasons, strict=True)}


@dataclass(slots=True)
class Placement:
    """A held request let go: its plan, the prefill charged at placement, what explain says."""

    plan: Plan
    charge: int
    waited_s: float
    priority: int
    flow: str
    note: str


@dataclass(slots=True)
class _Held:
    draft: Draft
    future: asyncio.Future[Placement]
    classified: Classified
    ahead: int  # queued before it at entry: in more important bands, and in its own
    error: GatewayError | None = None


class RouteFlow:
    """One route's queue, dispatcher and events (a ``ReplicaWatcher`` while anything is queued)."""

    def __init__(self, name: str, control: FlowControl) -> None:
        self.name = name
        self.control = control
        settings = control.settings
        self.queue = FlowQueue(settings.band)
        self.dispatcher = Dispatcher(self.queue, settings.affinity_wait_s, settings.lookahead)
        self.labels = FlowLabels(settings.flow_label_limit)
        self.runner: PolicyRunner | None = None  # the newest runner of the route a request came with
        self._watched: list[Replica] = []
        self._kick: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.saturated_since: float | None = None  # when a request last found it saturated, until it drains
        self.totals = dict.fromkeys(("queued", "dispatched", "shed", "refused", "expired", "cancelled"), 0)

    # -- the request path ------------------------------------------------------------
    def clear(self, runner: PolicyRunner, now: float) -> bool:
        """Nothing queued and the route not saturated: decide at once."""
        return not self.queue.count and not self._saturated(runner, now)

    def _saturated(self, runner: PolicyRunner, now: float) -> bool:
        return saturated([ReplicaSignals(r) for r in runner.eligible()], self.control.settings.saturation, now)

    async def wait(self, draft: Draft, headers: Mapping[str, str], key_hash: str | None, size: int) -> Placement:
        """Shed, refuse (queue full) or hold ``draft`` until it is placed; raises the error to answer."""
        control = self.control
        settings = control.settings
        now = control.clock()
        runner = draft.route.runner
        cls = classify(settings, headers, self.name, draft.route.config.flow_control.default_priority, key_hash)
        label = self.labels(cls.flow)
        is_saturated = self._saturated(runner, now)
        if is_saturated and self.saturated_since is None:
            self.saturated_since = now
        verdict = admit(is_saturated, self.queue.count, cls.priority)
        if verdict == "direct":  # drained between clear() and here
            return Placement(control.decide(draft), -1, 0.0, cls.priority, cls.flow, "")
        if verdict == "shed":
            self._count(cls.priority, label, "shed")
            raise self._error(
                RateLimited,
                f"route {self.name!r} is saturated and priority {cls.priority} is sheddable",
                "flow_control_shed",
            )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Placement] = loop.create_future()
        cost = draft.request.prompt_tokens_estimate or settings.fairness_quantum_tokens
        held = _Held(draft, future, cls, 0)
        try:
            entry = self.queue.push(cls.flow, cls.priority, cost, size, now, held)
        except QueueFull as full:
            self._count(cls.priority, label, "refused")
            raise self._error(
                RateLimited, f"route {self.name!r} is saturated and its queue is full ({full})", "flow_control_full"
            ) from None
        held.ahead = sum(self.queue.ahead_of(entry).values()) + self.queue.bands[cls.priority].count - 1
        self._count(cls.priority, label, "queued")
        self.runner = runner
        self._watch(runner.replicas)
        self._step()  # it may leave at once (the fair pick, a replica just freed)
        try:
            return await future
        except asyncio.CancelledError:
            if self.queue.remove(entry):
                self._count(cls.priority, label, "cancelled")
                self._kick_soon()
            elif future.done() and not future.cancelled() and future.exception() is None:
                self._undo(future.result())  # placed the moment its client left: give the room back
            raise
        finally:
            entry.item = None

    # -- dispatch ----------------------------------------------------------------------
    def _step(self) -> None:
        self._kick = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        control = self.control
        now = control.clock()
        step = self.dispatcher.step(self, now)
        for entry in step.expired:
            held: _Held = entry.item
            self._count(entry.priority, self.labels(entry.flow), "expired")
            error_type = RateLimited if control.settings.expired_status == 429 else Overloaded
            waited = now - entry.enqueued_at
            message = f"route {self.name!r} stayed saturated: the request waited {waited:.1f} s (its TTL) in the queue"
            _resolve(held.future, error=self._error(error_type, message, "flow_control_expired"))
        for entry in step.unplaceable:
            held = entry.item
            self._count(entry.priority, self.labels(entry.flow), "unplaceable")
            _resolve(held.future, error=held.error or NoHealthyReplica(f"no healthy replica for route {self.name!r}"))
        for entry, placement in step.dispatched:
            held = entry.item
            label = self.labels(entry.flow)
            self._count(entry.priority, label, "dispatched")
            control.metrics.waited(self.name, entry.priority, label, placement.waited_s)
            if not _resolve(held.future, placement):
                self._undo(placement)
        if not self.queue.count:
            self.saturated_since = None
            self._watch([])  # nothing to wake: the request path pays nothing for us
            return
        wake = now + RECHECK_S if step.wake_at is None else min(step.wake_at, now + RECHECK_S)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(0.0, wake - now), self._step)

    def _kick_soon(self) -> None:
        if self._kick is None and self.queue.count:
            self._kick = asyncio.get_running_loop().call_soon(self._step)

    # Placer (gateway.flow.dispatch) -------------------------------------------------
    def with_room(self, now: float) -> Collection[str]:
        runner = self.runner
        if runner is None:
            return ()
        full = route_room(runner.eligible(), self.control.settings.saturation, now)
        return [name for name, why in full.items() if why is None]

    def preferred(self, entry: Entry) -> str | None:
        held: _Held = entry.item
        try:
            return favourite(self.control.decide(held.draft, dry_run=True).decision)
        except NoHealthyReplica:
            return None

    def place(self, entry: Entry, allowed: Collection[str]) -> Placement | None:
        held: _Held = entry.item
        runner = held.draft.route.runner
        exclude = [r.name for r in runner.replicas if r.name not in allowed]
        try:
            plan = self.control.decide(held.draft, exclude)
        except NoHealthyReplica as exc:
            held.error = exc
            return None
        charge = runner.acquire(plan.replica, plan.request, plan.decision)
        now = self.control.clock()
        waited = now - entry.enqueued_at
        limits = self.control.settings.saturation
        room = _room_words(limits)
        note = (
            f"queued {waited * 1000:.0f} ms behind {held.ahead} request(s) (band {entry.priority}, flow "
            f"{self.labels(entry.flow)}); placed on {plan.replica.name} when it had room ({room})"
        )
        return Placement(plan, charge, waited, entry.priority, entry.flow, note)

    @staticmethod
    def _undo(placement: Placement) -> None:
        plan = placement.plan
        if placement.charge > 0:
            PolicyRunner.prefill_done(plan.replica, placement.charge)
        if placement.charge >= 0:
            plan.route.runner.release(plan.replica, plan.request, plan.decision, None, False, served=False)

    # -- events (gateway.replicas.pool.ReplicaWatcher, while anything is queued) --------
    def load_changed(self, replica: Replica, in_flight: int, pending: int) -> None:
        if in_flight < 0 or pending < 0:
            self._kick_soon()

    def state_changed(self, replica: Replica) -> None:
        self._kick_soon()

    def capacity_changed(self, replica: Replica) -> None:
        pass

    def _watch(self, replicas: list[Replica]) -> None:
        if replicas is self._watched:
            return
        for r in self._watched:
            r.unwatch(self)
        self._watched = replicas
        for r in replicas:
            r.watch(self)

    # -- bookkeeping ------------------------------------------------------------------
    def _count(self, band: int, label: str, event: str) -> None:
        if event in self.totals:
            self.totals[event] += 1
        self.control.metrics.count(self.name, band, label, event)

    def _error(self, kind: type[GatewayError], message: str, code: str) -> GatewayError:
        retry = self.control.settings.retry_after_s
        error = (
            RateLimited(message, retry_after_s=retry, code=code)
            if kind is RateLimited
            else Overloaded(message, what="flow_control", retry_after_s=retry)
        )
        if kind is Overloaded:
            error.code = code
        error.route = self.name
        return error

    def release_all(self) -> None:
        """Flow control was turned off: every held request goes now, wherever the policy says."""
        while (entry := self.queue.pop()) is not None:
            held: _Held = entry.item
            try:
                plan = self.control.decide(held.draft)
            except NoHealthyReplica as exc:
                _resolve(held.future, error=exc)
                continue
            charge = plan.route.runner.acquire(plan.replica, plan.request, plan.decision)
            waited = self.control.clock() - entry.enqueued_at
            placement = Placement(plan, charge, waited, entry.priority, entry.flow, "")
            if not _resolve(held.future, placement):
                self._undo(placement)
        self._watch([])

    def snapshot(self, now: float) -> dict[str, Any]:
        runner = self.runner
        bands = {}
        for band, info in self.queue.snapshot().items():
            labels: dict[str, int] = {}
            for flow, n in info["flows"].items():
                label = self.labels(flow)
                labels[label] = labels.get(label, 0) + n
            bands[band] = {"depth": info["depth"], "bytes": info["bytes"], "flow_labels": labels}
        return {
            "saturated": runner is not None and self._saturated(runner, now),
            "held": self.queue.count,  # now (the totals below count since start)
            "saturated_for_s": None if self.saturated_since is None else round(now - self.saturated_since, 3),
            "bands": bands,
            **self.totals,
        }


def _resolve(
    future: asyncio.Future[Placement], placement: Placement | None = None, *, error: Exception | None = None
) -> bool:
    """Hand the waiter its placement (or error); False when nobody waits any more."""
    if future.done():
        return False
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(placement)  # type: ignore[arg-type]
    return True


def _room_words(limits: SaturationSettings) -> str:
    words = []
    if limits.queued_prefill_tokens:
        words.append(f"queued prefill under {limits.queued_prefill_tokens} tokens")
    if limits.in_flight:
        words.append(f"in flight under {limits.in_flight}")
    if limits.waiting:
        words.append(f"engine waiting under {limits.waiting:g}")
    return ", ".join(words) or "no limit"


class FlowControl:
    """Every route's flow state, the settings they share, and their metrics."""

    def __init__(
        self,
        settings: FlowControlSettings,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.routes: dict[str, RouteFlow] = {}
        self.metrics = FlowMetrics(registry or CollectorRegistry(), self.snapshot)
        self.enabled = settings.enabled

    decide = staticmethod(decide)  # gateway.routing.plan.decide: the one way a draft is placed

    def of(self, route: str) -> RouteFlow:
        flow = self.routes.get(route)
        if flow is None:
            flow = self.routes[route] = RouteFlow(route, self)
        return flow

    async def hold(self, draft: Draft, headers: Mapping[str, str], key_hash: str | None, size: int) -> Placement | None:
        """None: decide ``draft`` now (flow control off, or its route has room and nothing
        queued: the fast path); else it waits in the route's queue and comes back placed
        (or raises the error to answer: shed, queue full, TTL).  Both data paths call this —
        the proxy and the endpoint picker — so a saturated route holds requests the same way."""
        if not self.enabled:
            return None
        flow = self.of(draft.route.name)
        if flow.clear(draft.route.runner, self.clock()):
            return None
        return await flow.wait(draft, headers, key_hash, size)

    def priority_of(self, route: Route, headers: Mapping[str, str], key_hash: str | None) -> int:
        """A request's priority on ``route`` (objective header, key, route default), for
        ``X-Vllm-Priority`` where the route forwards it but the request was never held."""
        return classify(
            self.settings, headers, route.name, route.config.flow_control.default_priority, key_hash
        ).priority

    def configure(self, settings: FlowControlSettings) -> None:
        """A reload: new bounds and TTLs apply to new requests (held ones keep their deadline);
        turned off, whatever is held goes now."""
        self.settings = settings
        self.enabled = settings.enabled
        for flow in self.routes.values():
            flow.queue.limits = settings.band
            flow.dispatcher.affinity_wait_s = settings.affinity_wait_s
            flow.dispatcher.lookahead = settings.lookahead
            flow.labels.limit = settings.flow_label_limit
            if not settings.enabled:
                flow.release_all()

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        return {name: flow.snapshot(now) for name, flow in self.routes.items()}

    def explain(self, route: Route, headers: Mapping[str, str], key_hash: str | None = None) -> dict[str, Any]:
        """``/admin/explain``'s section: what flow control would do with this request now, and why."""
        now = self.clock()
        settings = self.settings
        cls = classify(settings, headers, route.name, route.config.flow_control.default_priority, key_hash)
        limits = settings.saturation
        full = route_room(route.runner.eligible(), limits, now)
        is_saturated = bool(full) and all(full.values())
        held = self.routes[route.name].queue.count if route.name in self.routes else 0
        verdict = admit(is_saturated, held, cls.priority) if self.enabled else "direct"
        return {
            "enabled": self.enabled,
            "priority": cls.priority,
            "objective": cls.objective,
            "flow": cls.flow,  # an API key only as 16 hex of its sha256
            "saturated": is_saturated,
            "held": held,
            "would": verdict,  # direct | queue | shed
            "replicas_full": {name: why for name, why in full.items() if why},
        }
