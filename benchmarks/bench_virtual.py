"""Placement on a virtual clock: the policy benchmark's routing decisions, without the noise.

    python benchmarks/bench_virtual.py [--workload W ...] [--load moderate|saturated] [--seeds N] [--first-seed S]
        [--salts N] [--variant NAME:POLICY[:key=value,...] ...] [--hop-ms MS] [--hold TOKENS ...] [--quick] [--out DIR]
        [--flow [--flow-variant NAME:KEY=VALUE,... ...]]

``bench_policies.py`` replays each workload in real time through real processes on a 2-core
machine, and one cell's hit rate moves by 1.5-2.5 points from run to run: more than the
0.5-point verdicts it is judged on, so two settings closer than that cannot be told apart
there. This replays the *same* requests (same sample, same arrival times per load level) through

- the gateway's real pipeline (normalize, tokenize, hash: ``build_route``) and real policy
  runner (in-flight and queued-prefill accounting: ``decide``, ``acquire``, ``prefill_done``
  at the first token, ``release`` at the end), onto
- the simulator's real engine (continuous batching, chunked prefill, KV cache with prefix
  caching and preemption: ``gateway.sim.engine.Engine``, its own tokenizer and chat template),

driven by a discrete-event clock in simulated seconds instead of asyncio sleeps. A run is
deterministic and takes seconds, so the difference between two settings is the settings'.

Rows: ``prefix`` (the default), ``least_loaded``, ``round_robin``, any ``--variant``, the
pooled oracle (one engine with the fleet's KV and compute, as in ``bench_policies``) and
``sglang_like``: the SGLang router's ``cache_aware`` rule re-stated over the gateway's block
keys (the best match when it covers more than 30 % of the prompt, else the worker with the
smallest tree; the shortest queue when loads differ by more than 64 and 1.5x). It is a model of
the peer, not the peer: the real router stays a row of ``bench_policies.py``.

``--precise`` adds ``precise``: the ``prefix`` policy with every simulated engine's KV events
(the simulator's in-process callback: the batches its ZMQ publisher sends) feeding the
gateway's precise index (:mod:`gateway.kv_events`) on the virtual clock, and
``prefix_aligned``: the same requests keyed under a Llama 3.1 name, so the gateway tokenizes
as the simulator's llama3 engine does (events name token ids: precise matching needs the
engine's tokens; ``prefix`` keeps the deliberate mismatch), with the approximate model only.
The ``pred err`` column is the mean |predicted - reported cached tokens| per prompt token.

``--flow`` adds ``prefix+flow``: the ``prefix`` route behind the gateway's flow control as
shipped (:mod:`gateway.flow`: saturation, the priority/fairness queue, the late-binding
dispatcher; ``benchmarks/virtual_flow.py``), with the engines scraped on the virtual clock, and
prints issue 26's verdict per workload and level (medians over ``--seeds``). Workloads whose
requests name a tenant (``tenants``) get TTFT per tenant in the table and the JSON.

Left out by design: HTTP, the gateway's and the client's own latency (TTFT here is queueing
plus prefill in simulated time), and slow-replica detection (it reacts to wall-clock time).
Verdicts stay with ``bench_policies.py``; this is for design and tuning. Results: a table on
stdout and ``benchmarks/results/bench_virtual.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import xxhash

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_policies as bp  # noqa: E402
from benchmarks.bench_prefix_path import pct  # noqa: E402
from benchmarks.replay import wire_body  # noqa: E402
from benchmarks.workloads import TENANT_HEADER, BenchRequest, Workload, build  # noqa: E402
from gateway.config import HealthSettings, ReplicaConfig, RouteConfig  # noqa: E402
from gateway.flow.classify import named_flow  # noqa: E402
from gateway.flow.settings import FlowControlSettings  # noqa: E402
from gateway.kv_events.decoder import decode_events  # noqa: E402
from gateway.kv_events.index import PreciseIndex  # noqa: E402
from gateway.kv_events.ingest import Ingestor  # noqa: E402
from gateway.kv_events.routing import PreciseRouting  # noqa: E402
from gateway.kv_events.settings import KvEventsSettings  # noqa: E402
from gateway.prefix.pipeline import PrefixPipeline  # noqa: E402
from gateway.prefix.settings import NormalizeSettings, PrefixSettings  # noqa: E402
from gateway.replicas.engine import EngineStats  # noqa: E402
from gateway.replicas.pool import Replica  # noqa: E402
from gateway.routing import ring as ring_module  # noqa: E402
from gateway.routing.base import Decision, RequestView  # noqa: E402
from gateway.routing.routes import Route, build_route, request_view  # noqa: E402
from gateway.routing.runner import PolicyRunner  # noqa: E402
from gateway.sim import engine as sim_engine  # noqa: E402
from gateway.sim.engine import EngineRequest  # noqa: E402
from gateway.sim.options import SimOptions  # noqa: E402
from gateway.sim.protocol import APIError  # noqa: E402
from gateway.sim.replica import Replica as SimReplica  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_WORKLOADS = (
    "mooncake_synthetic",
    "mooncake_conversation",
    "rag",
    "agent_long",
    "agent",
    "agent_toolloop",
    "tenants",
)
QUICK_SIZE = 0.5
ALIGNED_MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # keyed with the simulator's own tokens (SimOptions.tokenizer)
#: the routes' token window (``prefix.window_tokens``'s default): past it the precise index keys no
#: block, the key chain goes on over text chunks and the engine's events bound the match by depth alone
WINDOW_TOKENS: int = PrefixSettings.model_fields["window_tokens"].default
# --kv: each replica's KV cache as a fraction of bench_policies' (the oracle pools the fleet's);
# "tight" is the KV-pressure cell of issue 23: half the blocks (a quarter stalls: one Mooncake
# request no longer fits), so the conversation trace evicts history it is asked for again
KV_LEVELS = {"default": 1.0, "tight": 0.5}
KV_FRACTION = 1.0
# --block-size: the engines' block size (bench_policies': 16, vLLM's GPU default); the caches keep
# their size in tokens. The routes follow it (block_size: auto, from the replicas' scraped size),
# so another engine than the one the policy was tuned on is one flag away (vLLM's CPU backend: 128)
ENGINE_BLOCK_SIZE: int | None = None


# -- the virtual clock ---------------------------------------------------------------------
class VirtualClock:
    """Simulated seconds; stands in for ``time`` inside the engine module while a run lasts."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class _Waiter:
    """The engine wakes a request's handler through ``waiter.set()``: here nobody waits."""

    def set(self) -> None:
        pass


# -- routers: who picks the engine ----------------------------------------------------------
Routed = tuple[int, dict[str, Any], Any]  # engine index, the body the engine receives, a handle
Arrival = tuple[float, BenchRequest, dict[str, Any], dict[str, str]]  # sim time, request, wire body, headers


class Router(Protocol):
    def route(self, req: BenchRequest, body: dict[str, Any], headers: dict[str, str]) -> Routed:
        """(engine index, the body the engine receives, a handle for the callbacks)."""
        ...

    def first_token(self, handle: Any) -> None: ...

    def finished(self, handle: Any, cached_tokens: int, prompt_tokens: int) -> None:
        """The request ended; ``prompt_tokens`` is what the engine's usage reports (as a reply's)."""
        ...

    def failed(self, handle: Any) -> None:
        """The engine refused the request before its cache saw it (a 400)."""
        ...


@contextlib.contextmanager
def salted_ring(salt: int) -> Iterator[None]:
    """While building a route: its ring's points hash with ``salt`` (``name#i#salt``), so
    every tie and ring placement differs while every rule stays the same — another, equally
    valid instance of the policy (salt 0: the shipped ring)."""
    if not salt:
        yield
        return
    shipped = ring_module.point
    ring_module.point = lambda name, index: xxhash.xxh3_64_intdigest(f"{name}#{index}#{salt}".encode())
    try:
        yield
    finally:
        ring_module.point = shipped


@dataclass(slots=True)
class _Held:
    replica: Replica
    view: RequestView
    decision: Decision
    charge: int
    predicted: int = 0
    answered: bool = False


FLOW_SETTINGS = FlowControlSettings()  # the fairness headers a gateway reads by default


class GatewayRouter:
    """One gateway route (the real pipeline, policy and runner) over ``n`` replicas.

    ``hold_tokens`` (an experiment, not a gateway feature): a request whose chosen replica
    already has more than this many prompt tokens queued for prefill waits in one queue at the
    gateway, in arrival order, and is decided again when a replica answers (late binding).
    """

    def __init__(
        self,
        policy: str,
        normalize: str,
        settings: dict[str, Any],
        n: int,
        hold_tokens: float | None = None,
        hold_fleet_tokens: float = 0.0,
        ring_salt: int = 0,
        gateway_model: str | None = None,
    ) -> None:
        health = HealthSettings()
        self.pool = [Replica(ReplicaConfig(name=f"r{i}", url=f"http://10.0.0.{i + 1}:8000"), None, health)  # type: ignore[arg-type]
                     for i in range(n)]  # fmt: skip
        config = RouteConfig(name="bench", policy=policy, normalize={"mode": normalize}, policy_settings=settings)
        # the model name the gateway keys requests under (None: the bench's own, a deliberate
        # mismatch with the simulator's llama3 tokenizer; ALIGNED_MODEL: the same tokens)
        self.gateway_model = gateway_model
        with salted_ring(ring_salt):  # the policy builds its ring from the pool here
            self.route_: Route = build_route(config, self.pool)
        engine = sim_options(n == 1)  # what the gateway's first scrape of each replica tells it
        for replica in self.pool:
            replica.set_engine(EngineStats(0.0, block_size=engine.block_size, num_gpu_blocks=engine.num_gpu_blocks))
        self.context_limit = engine.max_model_len  # what the gateway reads from the replicas' /v1/models
        self.index = {r.name: i for i, r in enumerate(self.pool)}
        self.reasons: dict[str, int] = {}
        self.predicted_tokens = 0  # the policy's predicted cached tokens, summed over decisions
        self.hold_tokens = hold_tokens
        self.hold_fleet_tokens = hold_fleet_tokens  # ...and only while the fleet's mean queue is over this
        self._prepared: dict[int, tuple[RequestView, dict[str, Any]]] = {}  # held requests: prepared once

    def _view(
        self, req: BenchRequest, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[RequestView, dict[str, Any]]:
        """What the gateway's request handler builds (as ``Gateway.plan``), and the body it forwards."""
        known = self._prepared.get(id(req))
        if known is not None:
            return known
        if self.gateway_model is not None:
            body = {**body, "model": self.gateway_model}
        route = self.route_
        route.follow_engines()  # block_size: auto — the engines' own size, as Gateway.plan reads it
        prepared = route.pipeline.prepare(req.endpoint, body) if route.needs_keys(req.endpoint) else None  # type: ignore[union-attr]
        flow = named_flow(FLOW_SETTINGS, headers)  # the tenant's fairness header, as Gateway.prepare reads it
        session = headers.get(route.session_header)
        limit = self.context_limit
        view = request_view(route.name, req.endpoint, body, prepared, session, flow=flow, context_limit=limit)
        return view, (prepared.body if prepared is not None else body)

    def holds(self, req: BenchRequest, body: dict[str, Any], headers: dict[str, str]) -> bool:
        """Whether the request waits at the gateway for now (``hold_tokens``)."""
        if self.hold_tokens is None:
            return False
        view, _ = self._prepared[id(req)] = self._view(req, body, headers)
        if self.hold_fleet_tokens and sum(r.pending_prefill_tokens for r in self.pool) <= self.hold_fleet_tokens * len(
            self.pool
        ):
            return False
        _, replica = self.route_.runner.decide(view, dry_run=True)
        return replica.pending_prefill_tokens > self.hold_tokens

    def route(
        self, req: BenchRequest, body: dict[str, Any], headers: dict[str, str], exclude: Collection[str] = ()
    ) -> Routed:
        view, sent = self._view(req, body, headers)
        self._prepared.pop(id(req), None)
        route = self.route_
        decision, replica = route.runner.decide(view, exclude)
        self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
        predicted = int(decision.detail.get("predicted_cached_tokens", 0))
        self.predicted_tokens += predicted
        charge = route.runner.acquire(replica, view, decision)
        return self.index[replica.name], sent, _Held(replica, view, decision, charge, predicted)

    def first_token(self, handle: _Held) -> None:
        if not handle.answered:  # as the gateway's Attempt.answered: once per request
            handle.answered = True
            PolicyRunner.answered(handle.replica, handle.charge)
            handle.charge = 0

    def finished(self, handle: _Held, cached_tokens: int, prompt_tokens: int) -> None:
        self.first_token(handle)
        self.route_.runner.release(handle.replica, handle.view, handle.decision, cached_tokens, True)
        self.route_.learn_prompt_tokens(handle.view, prompt_tokens)  # as the gateway's Attempt.release

    def failed(self, handle: _Held) -> None:
        """The engine refused the request (400: its prompt is over ``max_model_len``): as the
        gateway's Attempt on a 4xx, its prefill charge is given back and the policy takes back
        what it recorded for it."""
        self.first_token(handle)
        self.route_.runner.release(handle.replica, handle.view, handle.decision, None, False, served=False)


class PreciseGatewayRouter(GatewayRouter):
    """The ``prefix`` row with every simulated engine's KV events feeding the precise index.

    The events arrive through the simulator's in-process callback (the batches its ZMQ
    publisher would send, without sockets) at the end of each engine step, on the virtual
    clock; the gateway's own ingestion (:class:`~gateway.kv_events.ingest.Ingestor`) and
    matching (:class:`~gateway.kv_events.routing.PreciseRouting`) run as in production.
    """

    project = False  # kv_events.project_evictions: off here (the engine's word as is); on: `precise_projected`

    def attach_engines(self, engines: Sequence[Any], clock: VirtualClock) -> None:
        settings = KvEventsSettings(project_evictions=self.project)
        window = self.route_.pipeline.settings.window_tokens if self.route_.pipeline is not None else WINDOW_TOKENS
        self.ingestor = Ingestor(PreciseIndex(settings.max_bytes, window), clock.monotonic)
        routing = PreciseRouting(
            self.ingestor,
            settings.stale_s,
            settings.speculative_s,
            clock.monotonic,
            project=settings.project_evictions,
        )
        for replica, engine in zip(self.pool, engines, strict=True):
            name = replica.name
            self.ingestor.index.add(name, self.gateway_model or bp.MODEL)  # the seed the requests are keyed with
            self.ingestor.feed(name).subscribed = True

            def on_batch(batch: Any, name: str = name) -> None:
                self.ingestor.ingest(name, batch.data_parallel_rank, batch.seq, decode_events(batch.events))

            engine.kv_events.subscribe(on_batch)
        self.route_.attach_precise(routing)


class ProjectedGatewayRouter(PreciseGatewayRouter):
    """The ``precise`` row with ``kv_events.project_evictions`` on: the shipped default since 2026-12-03."""

    project = True


class SglangLikeRouter:
    """The SGLang router's ``cache_aware`` rule, restated over the gateway's block keys.

    Per worker, the set of prefix keys it was sent (its "tree") and their count (its size; the
    real router counts characters and evicts past 2^26 of them, which these runs never reach).
    The deepest key of the request a worker holds is its match. Load is requests in flight.
    """

    def __init__(
        self, n: int, cache_threshold: float = 0.3, abs_threshold: int = 64, rel_threshold: float = 1.5
    ) -> None:
        self.keys = PrefixPipeline(NormalizeSettings(mode="off"), PrefixSettings())  # the gateway rows' keys
        self.trees: list[set[int]] = [set() for _ in range(n)]
        self.load = [0] * n
        self.cache_threshold = cache_threshold
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.reasons: dict[str, int] = {}

    def route(self, req: BenchRequest, body: dict[str, Any], headers: dict[str, str]) -> Routed:
        prepared = self.keys.prepare(req.endpoint, body)
        keys = prepared.keys
        depth = _key_depths(prepared)
        total = max(prepared.prompt_tokens_estimate, 1)
        n = len(self.trees)
        lo, hi = min(self.load), max(self.load)
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            pick, reason = min(range(n), key=lambda i: (self.load[i], i)), "balance"
        else:
            matched = [0] * n
            for i, tree in enumerate(self.trees):
                for j in range(len(keys) - 1, -1, -1):  # deepest first
                    if keys[j] in tree:
                        matched[i] = depth[j]
                        break
            best = max(range(n), key=lambda i: (matched[i], -self.load[i], -i))
            if matched[best] / total > self.cache_threshold:
                pick, reason = best, "match"
            else:
                pick, reason = min(range(n), key=lambda i: (len(self.trees[i]), i)), "smallest_tree"
        self.trees[pick].update(keys)
        self.load[pick] += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        return pick, body, pick

    def first_token(self, handle: int) -> None:
        pass

    def finished(self, handle: int, cached_tokens: int, prompt_tokens: int) -> None:
        self.load[handle] -= 1

    def failed(self, handle: int) -> None:
        self.load[handle] -= 1


def _key_depths(prepared: Any) -> list[int]:
    """Prompt tokens covered up to each key of the chain (token blocks, then text keys)."""
    bs = prepared.block_size
    return [(j + 1) * bs for j in range(len(prepared.block_keys))] + list(prepared.text_key_tokens)


# -- the fleet on the virtual clock ------------------------------------------------------------
ARRIVE, STEP_END, ENQUEUE, FIRST_TOKEN, FINISHED, TIMER, SCRAPE = range(7)  # event kinds


class Gate(Protocol):
    """Flow control on the virtual clock (``benchmarks/virtual_flow.py``): a router that holds
    arrivals at the gateway and places each one when it lets it go (late binding).

    The fleet hands it every arrival, asks it after every event (an arrival, a first token, a
    finish, an engine step, its own timer, a scrape) which requests leave now, and scrapes the
    engines for it every ``scrape_interval`` simulated seconds (the gateway's metrics scrape).
    """

    scrape_interval: float

    def arrive(self, i: int, arrival: Arrival, now: float) -> None:
        """Request ``i`` reached the gateway."""
        ...

    def ready(self, now: float) -> Iterator[tuple[int, Routed | None]]:
        """Requests leaving the gateway now, in order: placed (``Routed``) or refused (None:
        shed, expired)."""
        ...

    def wake_at(self) -> float | None:
        """When the gateway must look again with nothing else happening (the next TTL)."""
        ...

    def scrape(self, engines: Sequence[Any], now: float) -> None:
        """The gateway's scrape of every engine's metrics."""
        ...


@dataclass
class Outcome:
    """What one request got: the replica, its prompt and cached tokens, its TTFT (sim seconds)."""

    engine: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    uncached: int = 0
    wait: float = 0.0  # from reaching the engine to its first scheduling (queueing, KV full)
    tenant: str | None = None  # the request's tenant (BenchRequest.tenant)
    # never reached an engine's cache: shed or expired at the gateway, or the engine's 400 (a prompt
    # over max_model_len)
    refused: bool = False
    sent: float = 0.0  # when the client sent it (sim seconds; later than its time in closed loop)
    # what its engine held of the prompt when the request was placed (the gateway's decision):
    # a gateway that knew each engine's cache exactly at that moment would predict this
    held_at_decision: int = 0
    predicted: int | None = None  # the gateway's predicted cached tokens (None: the row predicts none)


@dataclass
class VirtualFleet:
    """Engines stepping on one clock; events in time order (arrivals, step ends)."""

    options: list[SimOptions]
    clock: VirtualClock = field(default_factory=VirtualClock)

    def run(
        self,
        arrivals: Sequence[Arrival],
        router: Router,
        hop: float = 0.0,
        closed_loop: bool = False,
    ) -> list[Outcome]:
        """Replay ``arrivals`` through ``router``; ``hop`` (simulated seconds) delays the request's
        way to its engine and each answer's way back to the router (the gateway's own latency).

        ``closed_loop``: a request of a session (a conversation's next turn, an agent's next
        step) is sent no earlier than the previous request of that session is answered (its
        last token back at the client): the next turn resends that reply, so a real client
        cannot send it sooner.  Open loop (the default) keeps the workload's times, and at
        a compressed load level a turn often arrives while the one before is still in flight.
        TTFT counts from when the request was actually sent."""
        replicas = [SimReplica(o) for o in self.options]
        engines = [r.engine for r in replicas]
        attach = getattr(router, "attach_engines", None)
        if attach is not None:  # the precise row: the engines' KV events feed the router
            attach(engines, self.clock)
        seed = replicas[0].block_seed(None, None)
        outcomes: list[Outcome | None] = [None] * len(arrivals)
        events: list[tuple[float, int, int, Any]] = []  # (time, seq, kind, payload)
        seq = 0
        busy = [False] * len(engines)
        meta: dict[int, tuple[int, Any, int]] = {}  # id(engine request) -> (request index, handle, engine)
        sent_at = [t for t, *_rest in arrivals]  # when each request left the client
        next_of = _next_in_session(arrivals) if closed_loop else {}
        waits_for = set(next_of.values())  # sent once the request before it is answered
        for i, t in enumerate(sent_at):
            if i not in waits_for:
                events.append((t, seq, ARRIVE, i))
                seq += 1
        heapq.heapify(events)

        def answered(i: int, now: float) -> None:
            """Request ``i``'s client has its whole answer at ``now``: its session's next request goes."""
            k = next_of.get(i)
            if k is not None:
                sent_at[k] = max(arrivals[k][0], now)
                later(sent_at[k], ARRIVE, k)

        held: deque[int] = deque()  # arrived, not yet placed (only while the router holds them)
        holds = getattr(router, "holds", None)
        gate: Gate | None = router if hasattr(router, "ready") else None  # type: ignore[assignment]
        timers: set[float] = set()  # the gate's wake-ups already on the clock

        def dispatch(i: int, now: float, routed: Routed | None = None) -> None:
            _, req, body, headers = arrivals[i]
            e, sent, handle = routed if routed is not None else router.route(req, body, headers)
            replica = replicas[e]
            tokens = _engine_tokens(replica, req.endpoint, sent)
            try:  # what the engine's HTTP front checks first (this fleet hands requests straight in)
                replica.check_prompt_len(len(tokens), text=False)
            except APIError:  # a prompt over max_model_len: vLLM answers 400, nothing is cached
                outcomes[i] = Outcome(e, tenant=req.tenant, refused=True, sent=sent_at[i])
                router.failed(handle)
                answered(i, now + hop)
                return
            (ereq,) = replica.engine_requests(tokens, req.max_tokens, "length", 1, seed, now + hop)
            ereq.waiter = _Waiter()
            ereq.stream = True
            meta[id(ereq)] = (i, handle, e)
            held = len(engines[e].cache.lookup(ereq.keys, ereq.num_prompt + ereq.num_output)) * engines[e].block_size
            outcomes[i] = Outcome(
                e,
                prompt_tokens=len(tokens),
                tenant=req.tenant,
                sent=sent_at[i],
                held_at_decision=held,
                predicted=getattr(handle, "predicted", None),
            )
            if hop:
                later(now + hop, ENQUEUE, (e, ereq))
            else:
                enqueue(e, ereq, now)

        def later(t: float, kind: int, payload: Any) -> None:
            nonlocal seq
            heapq.heappush(events, (t, seq, kind, payload))
            seq += 1

        def enqueue(e: int, ereq: EngineRequest, now: float) -> None:
            engines[e].waiting.append(ereq)
            if not busy[e]:
                start_step(e, now)

        def start_step(e: int, now: float) -> None:
            engine = engines[e]
            scheduled, prefill = engine._schedule()
            if not scheduled:
                busy[e] = False
                if engine.waiting:
                    raise RuntimeError(f"engine {e} stalled with {len(engine.waiting)} waiting requests")
                return
            busy[e] = True
            duration = engine.step_base_s + prefill / engine.prefill_tps
            later(now + duration, STEP_END, (e, scheduled))

        def let_go(now: float) -> None:
            """The gate's requests that leave now, placed or refused; its next wake-up on the clock."""
            assert gate is not None
            for i, routed in gate.ready(now):
                if routed is None:
                    outcomes[i] = Outcome(-1, tenant=arrivals[i][1].tenant, refused=True)
                    answered(i, now)
                else:
                    dispatch(i, now, routed)
            wake = gate.wake_at()
            if wake is not None and wake not in timers:
                timers.add(wake)
                # the clock must move on: a wake-up already due is looked at one tick later
                later(max(wake, math.nextafter(now, math.inf)), TIMER, wake)

        if gate is not None:
            gate.scrape(engines, 0.0)
            later(gate.scrape_interval, SCRAPE, None)
        saved = sim_engine.time
        sim_engine.time = SimpleNamespace(monotonic=self.clock.monotonic)  # type: ignore[assignment]
        try:
            while events:
                now, _, kind, payload = heapq.heappop(events)
                self.clock.now = now
                if kind == ARRIVE and gate is not None:
                    gate.arrive(payload, arrivals[payload], now)
                elif kind == ARRIVE:
                    held.append(payload)
                elif kind == TIMER:
                    timers.discard(payload)
                elif kind == SCRAPE:
                    assert gate is not None
                    gate.scrape(engines, now)
                    if events:  # scrapes go on while anything else will happen
                        later(now + gate.scrape_interval, SCRAPE, None)
                elif kind == ENQUEUE:
                    enqueue(*payload, now)
                elif kind == FIRST_TOKEN:
                    router.first_token(payload)
                elif kind == FINISHED:
                    router.finished(*payload)
                else:
                    e, scheduled = payload
                    engines[e]._apply(scheduled)
                    for ereq, _n in scheduled:
                        i, handle, _ = meta.get(id(ereq), (None, None, None))
                        if i is None:
                            continue
                        out = outcomes[i]
                        assert out is not None
                        if ereq.num_output >= 1 and out.ttft == 0.0 and ereq.first_token_at == now:
                            out.ttft = now + hop - sent_at[i]  # as the client sees it
                            out.cached_tokens = max(ereq.cached_tokens, 0)
                            out.uncached = out.prompt_tokens - out.cached_tokens
                            out.wait = ereq.scheduled_at - ereq.arrival
                            if hop:
                                later(now + hop, FIRST_TOKEN, handle)
                            else:
                                router.first_token(handle)
                        if ereq.finished:
                            if hop:
                                later(now + hop, FINISHED, (handle, out.cached_tokens, out.prompt_tokens))
                            else:
                                router.finished(handle, out.cached_tokens, out.prompt_tokens)
                            answered(i, now + hop)
                            del meta[id(ereq)]
                    start_step(e, now)
                if gate is not None:
                    let_go(now)
                # held requests leave in arrival order, each as soon as the router lets it go
                if held:
                    waiting = list(held)
                    held.clear()
                    for i in waiting:
                        if holds is not None and holds(*arrivals[i][1:]):
                            held.append(i)
                        else:
                            dispatch(i, now)
        finally:
            sim_engine.time = saved
        done = [o for o in outcomes if o is not None]  # refused ones included: the gateway answered them
        if len(done) != len(arrivals) or meta:
            raise RuntimeError(f"{len(arrivals) - len(done)} requests never finished")
        return done


def _next_in_session(arrivals: Sequence[Arrival]) -> dict[int, int]:
    """Request index -> the index of the next request of its session (arrival order) that
    answers it: a conversation's next turn or an agent's next tool step (``kind`` "turn" or
    "step": the workload resends the history, though a per-request header on top may
    differ) or any request whose prompt starts with the earlier one's.  Requests that only
    share a session and part of a prompt (a batch job's map steps over one document) are
    independent and keep their times."""
    last: dict[str, int] = {}
    out: dict[int, int] = {}
    for i, (_t, req, *_rest) in enumerate(arrivals):
        if req.session:
            j = last.get(req.session)
            if j is not None and (req.kind in ("turn", "step") or _resends(arrivals[j][1], req)):
                out[j] = i
            last[req.session] = i
    return out


def _resends(earlier: BenchRequest, later: BenchRequest) -> bool:
    """Whether ``later``'s prompt begins with the whole of ``earlier``'s."""
    if "messages" in earlier.body and "messages" in later.body:
        before, after = earlier.body["messages"], later.body["messages"]
        return len(after) > len(before) and after[: len(before)] == before
    before_text, after_text = earlier.body.get("prompt"), later.body.get("prompt")
    return isinstance(before_text, str) and isinstance(after_text, str) and after_text.startswith(before_text)


def _engine_tokens(replica: SimReplica, endpoint: str, body: dict[str, Any]) -> list[int]:
    """The prompt as the replica's own tokenizer and chat template see it."""
    if endpoint == "chat":
        return replica.prompts.chat(body["messages"], body.get("tools"), True)
    return replica.prompts.completion(body["prompt"])


# -- one workload at one level -----------------------------------------------------------------
def arrivals_for(wl: Workload, level: str, requests: Sequence[BenchRequest] | None = None) -> list[Arrival]:
    """Arrival times in simulated seconds at the level's offered load, with the wire body and headers."""
    sim = bp.SIM
    util = bp.LOADS[wl.name][level]
    time_scale = bp.time_scale_for(wl, sim, bp.REPLICAS)
    sim_seconds_per_workload_second = bp.time_factor_for(wl, util, time_scale, sim, bp.REPLICAS) / time_scale
    reqs = wl.requests if requests is None else requests
    t0 = reqs[0].t
    out = []
    for r in reqs:
        body = wire_body(r, bp.MODEL)
        headers = {"x-session-id": r.session} if r.session else {}
        if r.tenant:
            headers[TENANT_HEADER] = r.tenant
        out.append(((r.t - t0) * sim_seconds_per_workload_second, r, body, headers))
    return out


def sim_options(oracle: bool) -> SimOptions:
    keys = {
        k: v for k, v in bp.SIM.items() if k not in ("enable_admin", "disable_uvicorn_access_log", "disable_log_stats")
    }
    keys["time_scale"] = 1.0
    if oracle:
        keys.update(bp.ORACLE_SIM)
    if KV_FRACTION != 1.0:
        keys["num_gpu_blocks"] = max(1, int(keys["num_gpu_blocks"] * KV_FRACTION))
    if ENGINE_BLOCK_SIZE is not None and keys["block_size"] != ENGINE_BLOCK_SIZE:
        keys["num_gpu_blocks"] = max(1, keys["num_gpu_blocks"] * keys["block_size"] // ENGINE_BLOCK_SIZE)
        keys["block_size"] = ENGINE_BLOCK_SIZE
    return SimOptions(**keys)


def alone_ttft(uncached: int, options: SimOptions) -> float:
    """A request's TTFT on an idle replica with the same cache: its prefill chunks, nothing queued
    (each engine step lasts the decode step + its chunk's prefill; vLLM recomputes at least one token)."""
    uncached = max(uncached, 1)
    steps = -(-uncached // options.max_num_batched_tokens)
    return steps * options.decode_ms_per_token / 1000.0 + uncached / options.prefill_tokens_per_s


def summarize(outcomes: Sequence[Outcome], n: int, options: SimOptions | None = None) -> dict[str, Any]:
    """Hit rate, TTFT percentiles (simulated ms), prefill-work balance and the no-queue floor;
    per tenant when requests name one; requests the gateway refused counted apart."""
    refused = [o for o in outcomes if o.refused]
    outcomes = [o for o in outcomes if not o.refused]
    prompt = sum(o.prompt_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    ttfts = [o.ttft for o in outcomes]
    floor = [alone_ttft(o.uncached, options or sim_options(n == 1)) for o in outcomes]
    work = [0] * n
    for o in outcomes:
        work[o.engine] += o.uncached
    mean = sum(work) / n
    return {
        "requests": len(outcomes),
        "prompt_tokens": prompt,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": 1000 * pct(ttfts, 0.5),
        "ttft_p90_ms": 1000 * pct(ttfts, 0.9),
        "ttft_p99_ms": 1000 * pct(ttfts, 0.99),
        # the same requests with the same cache hits, each alone on its replica: no placement
        # can bring TTFT below this (the pooled oracle's replica prefills 4x faster)
        "alone_p50_ms": 1000 * pct(floor, 0.5),
        "alone_p90_ms": 1000 * pct(floor, 0.9),
        "wait_p90_ms": 1000 * pct([o.wait for o in outcomes], 0.9),
        "work_max_mean": max(work) / mean if mean else 1.0,
        # mean |held at decision - reported cached tokens| per prompt token: the error of a
        # prediction that knew the engine's cache exactly when the request was placed (what
        # changes between placement and admission: evictions, preemptions, a sibling's blocks)
        "decision_state_error": sum(abs(o.held_at_decision - o.cached_tokens) for o in outcomes) / prompt
        if prompt
        else 0.0,
        "refused": len(refused),
        # mean |predicted - reported cached tokens| per prompt token, and its parts
        **(
            {
                "prediction_error": sum(abs((o.predicted or 0) - o.cached_tokens) for o in outcomes) / prompt,
                "error_split": error_split(outcomes, prompt),
                "prediction_error_past_window": error_past_window(outcomes, prompt),
            }
            if prompt and any(o.predicted is not None for o in outcomes)
            else {}
        ),
        **({"tenants": tenant_figures(outcomes, refused)} if any(o.tenant for o in outcomes) else {}),
    }


def error_split(outcomes: Sequence[Outcome], prompt: int) -> dict[str, float]:
    """The prediction error (mean |predicted - reported| per prompt token) split by what the chosen
    engine held of the prompt when the request was placed (``held_at_decision``); the four parts
    add up to the row's ``prediction_error``:

    - ``gone``: predicted content the engine no longer held at decision (a belief its events, or
      the model, should have corrected);
    - ``evicted``: predicted content it held at decision but evicted before the request ran
      (forecast: the work queued ahead evicted it);
    - ``missed``: content it held at decision that the prediction did not credit;
    - ``arrived``: content it did not hold at decision but did at admission (a sibling in flight
      stored it first)."""
    parts = dict.fromkeys(("gone", "evicted", "missed", "arrived"), 0)
    for o in outcomes:
        predicted, held, cached = o.predicted or 0, o.held_at_decision, o.cached_tokens
        if predicted > cached:
            parts["gone"] += max(0, predicted - max(held, cached))
            parts["evicted"] += max(0, min(predicted, held) - cached)
        else:
            parts["missed"] += max(0, min(held, cached) - predicted)
            parts["arrived"] += cached - max(predicted, min(held, cached))
    return {k: v / prompt for k, v in parts.items()}


def error_past_window(outcomes: Sequence[Outcome], prompt: int, window: int = WINDOW_TOKENS) -> float:
    """The part of the prediction error (mean |predicted - reported| per prompt token) on content
    past the first ``window`` tokens: |max(predicted, W) - max(reported, W)| per request.  The rest
    is inside the window; the two add up to the row's ``prediction_error`` (each request's
    difference splits at W into two parts of one sign).  Measured (Mooncake synthetic @ saturated,
    samples 0-39): 0.66 of 0.77 points past the window, where only the model and the text tail
    match and the engine's events bound by depth."""
    return sum(abs(max(o.predicted or 0, window) - max(o.cached_tokens, window)) for o in outcomes) / prompt


def tenant_figures(served: Sequence[Outcome], refused: Sequence[Outcome]) -> dict[str, Any]:
    """Per tenant: requests, refused, TTFT p50/p90 (simulated ms) of those served."""
    out: dict[str, Any] = {}
    for name in sorted({o.tenant or "-" for o in [*served, *refused]}):
        ttfts = [o.ttft for o in served if (o.tenant or "-") == name]
        out[name] = {
            "requests": len(ttfts),
            "refused": sum((o.tenant or "-") == name for o in refused),
            "ttft_p50_ms": 1000 * pct(ttfts, 0.5) if ttfts else 0.0,
            "ttft_p90_ms": 1000 * pct(ttfts, 0.9) if ttfts else 0.0,
        }
    return out


Row = tuple[str, Callable[[], Router], bool]  # name, router factory, oracle


SALT_MARK = "~"  # a salted copy of a row: "prefix~2" is "prefix" on ring instance 2


def rows_for(
    wl: Workload,
    variants: Sequence[tuple[str, str, dict[str, Any]]],
    peers: bool,
    hold: Sequence[float | str] = (),
    salts: int = 1,
    precise: bool = False,
    project: bool = False,
    flow: bool = False,
    flow_variants: Sequence[str] = (),
) -> list[Row]:
    """The rows of one workload: ``prefix``, the variants and hold rows (each also on ``salts``
    - 1 more ring instances, see :func:`salted_ring`), the peers, the oracle."""
    n = bp.REPLICAS
    gateway_rows: list[tuple[str, Callable[..., Router]]] = [
        ("prefix", partial(GatewayRouter, "prefix", wl.normalize, {}, n))
    ]
    for name, policy, settings in variants:
        gateway_rows.append((name, partial(GatewayRouter, policy, wl.normalize, dict(settings), n)))
    if precise:
        # Events name token ids: the route must tokenize as the engine does (the simulator's
        # llama3 vocabulary and Llama 3.1 template: the gateway picks them for a Llama 3.1 name;
        # the `prefix` row keeps the deliberate mismatch), so the approximate model gets the same
        # alignment as a row of its own: `prefix_aligned`.
        aligned = {"gateway_model": ALIGNED_MODEL}
        gateway_rows.append(("prefix_aligned", partial(GatewayRouter, "prefix", wl.normalize, {}, n, **aligned)))
        gateway_rows.append(("precise", partial(PreciseGatewayRouter, "prefix", wl.normalize, {}, n, **aligned)))
        if project:
            gateway_rows.append(
                ("precise_projected", partial(ProjectedGatewayRouter, "prefix", wl.normalize, {}, n, **aligned))
            )
    if flow:  # flow control as shipped in front of the `prefix` route (benchmarks/virtual_flow.py)
        from benchmarks.virtual_flow import ROW, FlowGatewayRouter

        gateway_rows.append((ROW, partial(FlowGatewayRouter, "prefix", wl.normalize, {}, n)))
        if precise and project:  # every default at once: precise (projected) routing behind flow control
            from benchmarks.virtual_flow import SHIPPED_ROW, ShippedGatewayRouter

            shipped = partial(ShippedGatewayRouter, "prefix", wl.normalize, {}, n, gateway_model=ALIGNED_MODEL)
            gateway_rows.append((SHIPPED_ROW, shipped))
    for spec in flow_variants:  # other flow-control settings, for tuning its defaults
        from benchmarks.virtual_flow import FlowGatewayRouter, parse_flow_variant

        name, settings = parse_flow_variant(spec)
        router = partial(FlowGatewayRouter, "prefix", wl.normalize, {}, n, flow=settings)
        gateway_rows.append((name, router))
        if precise and project:  # ... and behind every other default (the shipped row's variant)
            from benchmarks.virtual_flow import SHIPPED_ROW, ShippedGatewayRouter

            variant = partial(ShippedGatewayRouter, "prefix", wl.normalize, {}, n, flow=settings)
            gateway_rows.append(
                (SHIPPED_ROW + name.removeprefix("prefix"), partial(variant, gateway_model=ALIGNED_MODEL))
            )
    for spec in hold:
        tokens, _, fleet = str(spec).partition(":")
        name = f"prefix_hold{float(tokens):g}" + (f"_fleet{float(fleet):g}" if fleet else "")
        hold_row = partial(GatewayRouter, "prefix", wl.normalize, {}, n, float(tokens), float(fleet or 0))
        gateway_rows.append((name, hold_row))
    rows: list[Row] = []
    for name, factory in gateway_rows:
        rows.append((name, factory, False))
        rows.extend((f"{name}{SALT_MARK}{salt}", partial(factory, ring_salt=salt), False) for salt in range(1, salts))
    if peers:
        rows.append(("least_loaded", lambda: GatewayRouter("least_loaded", wl.normalize, {}, n), False))
        rows.append(("sglang_like", lambda: SglangLikeRouter(n), False))
    rows.append(("oracle", lambda: GatewayRouter("prefix", wl.normalize, {}, 1), True))
    return rows


def run_level(
    wl: Workload, level: str, rows: Sequence[Row], hop_ms: float = 0.0, closed_loop: bool = False
) -> dict[str, Any]:
    """Every row on one workload sample at one level; ``hop_ms``: the gateway's latency per hop, in
    wall milliseconds of ``bench_policies`` (converted with the workload's clock compression);
    ``closed_loop``: see :meth:`VirtualFleet.run`."""
    arrivals = arrivals_for(wl, level)
    hop = hop_ms / 1000.0 / bp.time_scale_for(wl, bp.SIM, bp.REPLICAS)
    out: dict[str, Any] = {}
    for name, factory, oracle in rows:
        t0 = time.perf_counter()
        router = factory()
        n = 1 if oracle else bp.REPLICAS
        fleet = VirtualFleet([sim_options(oracle) for _ in range(n)])
        stats = summarize(fleet.run(arrivals, router, 0.0 if oracle else hop, closed_loop), n, fleet.options[0])
        stats["decisions"] = dict(sorted(getattr(router, "reasons", {}).items()))
        if hasattr(router, "figures"):  # flow control's queue
            stats["flow"] = router.figures()
        predicted = getattr(router, "predicted_tokens", None)
        if predicted is not None and stats["prompt_tokens"]:
            # what the gateway told /admin/stats it expected, against what the engines reported
            stats["predicted_hit_rate"] = predicted / stats["prompt_tokens"]
        stats["seconds"] = round(time.perf_counter() - t0, 2)
        out[name] = stats
    return out


def print_table(wname: str, level: str, cells: dict[str, Any]) -> None:
    oracle = cells.get("oracle", {}).get("hit_rate") or 0.0
    print(f"\n{wname} @ {level} ({cells['prefix']['requests']} requests)")
    print(
        f"  {'row':<22} {'hit %':>7} {'% orcl':>7} {'pred %':>7} "
        + " ".join(f"{h:>8}" for h in ("p50 ms", "p90 ms", "p99 ms", "alone90"))
        + f" {'work':>5} {'pred err':>8}  decisions"
    )
    for name, s in cells.items():
        rel = 100 * s["hit_rate"] / oracle if oracle else 0.0
        predicted = f"{100 * s['predicted_hit_rate']:7.2f}" if "predicted_hit_rate" in s else f"{'-':>7}"
        print(
            f"  {name:<22} {100 * s['hit_rate']:7.2f} {rel:7.1f} {predicted}"
            f" {s['ttft_p50_ms']:8.0f} {s['ttft_p90_ms']:8.0f} {s['ttft_p99_ms']:8.0f}"
            f" {s['alone_p90_ms']:8.0f} {s['work_max_mean']:5.2f}"
            + (f" {100 * s['prediction_error']:7.2f}%" if "prediction_error" in s else f" {'-':>8}")
            + f"  {s['decisions']}"
        )
        if "tenants" in s or s.get("refused") or "flow" in s:
            print(f"  {'':<22} " + describe_extras(s))


def describe_extras(s: dict[str, Any]) -> str:
    """The second line of a row: per-tenant TTFT, refused requests, flow control's queue."""
    parts = [
        f"{name} p50/p90 {t['ttft_p50_ms']:.0f}/{t['ttft_p90_ms']:.0f} ms ({t['requests']} req)"
        for name, t in s.get("tenants", {}).items()
    ]
    if s.get("refused"):
        parts.append(f"refused {s['refused']}")
    flow = s.get("flow")
    if flow:
        parts.append(
            f"flow: queued {flow['queued']}, gateway wait p90 {flow['wait_p90_ms']:.0f} ms, "
            f"engine wait p90 {s['wait_p90_ms']:.0f} ms"
        )
    return "; ".join(parts)


SUMMARY_SERIES = ("hit_pct_oracle", "hit_points_vs_prefix", "p50_x_prefix", "p90_x_prefix", "p90_x_oracle",
                  "alone_p90_x_oracle", "work_max_mean")  # fmt: skip


def pct_of_oracle(cell: dict[str, Any], oracle: dict[str, Any]) -> float:
    """A row's hit rate as % of the pooled oracle's in the same sample (0 when the oracle hit nothing)."""
    return 100 * cell["hit_rate"] / oracle["hit_rate"] if oracle["hit_rate"] else 0.0


def relative_summary(per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per row, over the seeds: hit rate as % of the oracle's, TTFT p50/p90 and work balance as
    multiples of the ``prefix`` row's and the oracle's (mean, min and max)."""
    out: dict[str, Any] = {}
    for name in per_seed[0]:
        series: dict[str, list[float]] = {k: [] for k in SUMMARY_SERIES}
        for cells in per_seed:
            s, base, oracle = cells[name], cells["prefix"], cells["oracle"]
            series["hit_pct_oracle"].append(pct_of_oracle(s, oracle))
            series["hit_points_vs_prefix"].append(100 * (s["hit_rate"] - base["hit_rate"]))
            series["p50_x_prefix"].append(s["ttft_p50_ms"] / base["ttft_p50_ms"] if base["ttft_p50_ms"] else 0.0)
            series["p90_x_prefix"].append(s["ttft_p90_ms"] / base["ttft_p90_ms"] if base["ttft_p90_ms"] else 0.0)
            series["p90_x_oracle"].append(s["ttft_p90_ms"] / oracle["ttft_p90_ms"] if oracle["ttft_p90_ms"] else 0.0)
            series["alone_p90_x_oracle"].append(
                s["alone_p90_ms"] / oracle["ttft_p90_ms"] if oracle["ttft_p90_ms"] else 0.0
            )
            series["work_max_mean"].append(s["work_max_mean"])
        out[name] = {k: {"mean": sum(v) / len(v), "min": min(v), "max": max(v)} for k, v in series.items()}
    return out


PRECISE_ROWS = ("prefix_aligned", "precise", "precise_projected", "shipped", "sglang_like", "oracle")


def precise_medians(per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The issue's view of the ``--precise`` rows over the samples: each row's median hit rate
    and prediction error, and the median over samples of each precise row's hit rate minus
    the approximate row's and the SGLang row's (paired: the same sample)."""
    rows = [row for row in PRECISE_ROWS if all(row in cells for cells in per_seed)]
    out: dict[str, Any] = {"rows": {}, "paired": {}}
    for row in rows:
        errors = [cells[row].get("prediction_error") for cells in per_seed]
        out["rows"][row] = {
            "hit_rate": statistics.median(cells[row]["hit_rate"] for cells in per_seed),
            "prediction_error": statistics.median(errors) if None not in errors else None,
            "decision_state_error": statistics.median(cells[row]["decision_state_error"] for cells in per_seed),
        }
        past = [cells[row].get("prediction_error_past_window") for cells in per_seed]
        if None not in past:
            out["rows"][row]["prediction_error_past_window"] = statistics.median(past)
        splits = [cells[row].get("error_split") for cells in per_seed]
        if None not in splits:  # the mean over samples: the parts of the mean error (medians would not add up)
            out["rows"][row]["error_split_mean"] = {k: statistics.fmean(s[k] for s in splits) for k in splits[0]}
    for row in ("precise", "precise_projected", "shipped"):
        for peer in ("prefix_aligned", "sglang_like"):
            if row in rows and peer in rows:
                diffs = [cells[row]["hit_rate"] - cells[peer]["hit_rate"] for cells in per_seed]
                out["paired"][f"{row}-{peer}"] = statistics.median(diffs)
                out.setdefault("paired_spread", {})[f"{row}-{peer}"] = paired_spread(diffs)
    return out


#: samples from which a paired comparison gets a bootstrap interval for its median
SPREAD_MIN_SAMPLES = 10


def paired_spread(diffs: Sequence[float], resamples: int = 2000) -> dict[str, Any]:
    """How far a paired median over samples can be trusted: the mean, the wins and losses,
    and from ``SPREAD_MIN_SAMPLES`` samples a 95 % bootstrap interval of the median.

    Placement at saturation is chaotic: one rule's hit rate moves by a point or more between
    samples, and between ring salts of one sample, while the difference of two rules stays
    near zero on average. The median of three samples then flips with the samples drawn
    (Mooncake synthetic @ saturated: `shipped` - `sglang_like` is -0.83 on samples 0-2 and
    +0.21 over samples 0-39), so a verdict near its bar is read with its interval. The
    resampling is seeded: the same samples give the same interval."""
    out: dict[str, Any] = {
        "samples": len(diffs),
        "mean": statistics.fmean(diffs) if diffs else 0.0,
        "wins": sum(d > 0 for d in diffs),
        "losses": sum(d < 0 for d in diffs),
    }
    if len(diffs) >= SPREAD_MIN_SAMPLES:
        rng = random.Random(0)
        medians = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(resamples))
        out["median_ci95"] = [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]
    return out


def print_precise_medians(wname: str, level: str, medians: dict[str, Any]) -> None:
    print(
        f"{wname} @ {level}: medians over samples (hit %, pred err %, the engine's state at decision as the "
        "prediction: err %; paired: median of differences, points)"
    )
    for row, cell in medians["rows"].items():
        error = "-" if cell["prediction_error"] is None else f"{100 * cell['prediction_error']:.2f}"
        split = cell.get("error_split_mean")
        parts = "  mean err = " + " + ".join(f"{k} {100 * v:.2f}" for k, v in split.items()) if split else ""
        if cell.get("prediction_error_past_window") is not None:
            parts += f"; past the window {100 * cell['prediction_error_past_window']:.2f} (median)"
        print(
            f"  {row:<22} {100 * cell['hit_rate']:6.2f} {error:>6} {100 * cell.get('decision_state_error', 0):6.2f}"
            + parts
        )
    spreads = medians.get("paired_spread", {})
    for pair, diff in medians["paired"].items():
        spread = spreads.get(pair)
        extra = ""
        if spread:
            extra = f"  mean {100 * spread['mean']:+.2f}, {spread['wins']} won / {spread['losses']} lost"
            if "median_ci95" in spread:
                low, high = spread["median_ci95"]
                extra += f", median 95% CI [{100 * low:+.2f}, {100 * high:+.2f}]"
        print(f"  {pair:<38} {100 * diff:+6.2f}{extra}")


def print_summary(wname: str, level: str, summary: dict[str, Any]) -> None:
    print(f"\n{wname} @ {level}: mean over seeds [min, max]")
    heads = ("p50 x prefix", "p90 x prefix", "p90 x oracle", "alone90 x orc")
    print(f"  {'row':<22} {'hit % of oracle':>22} {'pts vs prefix':>20} " + " ".join(f"{h:>13}" for h in heads))
    for name, s in summary.items():
        h, d = s["hit_pct_oracle"], s["hit_points_vs_prefix"]
        hit = f"{h['mean']:6.1f} [{h['min']:5.1f}, {h['max']:5.1f}]"
        points = f"{d['mean']:+6.2f} [{d['min']:+5.1f}, {d['max']:+5.1f}]"
        ratios = " ".join(
            f"{s[k]['mean']:13.2f}" for k in ("p50_x_prefix", "p90_x_prefix", "p90_x_oracle", "alone_p90_x_oracle")
        )
        print(f"  {name:<22} {hit} {points} {ratios}")


def ensemble_summary(per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per row family (a row and its salted copies, ``--salts``), over seeds x ring instances:
    hit rate as % of the oracle (mean, min, max), its spread between instances of one sample
    (the mean over seeds of their standard deviation: what one run cannot resolve), points
    against the ``prefix`` family (family means, per seed: mean, min, max) and p90 x oracle."""
    families: dict[str, list[str]] = {}
    for name in per_seed[0]:
        families.setdefault(name.split(SALT_MARK)[0], []).append(name)
    base = families.get("prefix", [])
    out: dict[str, Any] = {}
    for family, names in families.items():
        if len(names) < 2:
            continue
        pct_oracle: list[float] = []
        spread: list[float] = []
        points: list[float] = []
        p90: list[float] = []
        for cells in per_seed:
            oracle = cells["oracle"]
            values = [pct_of_oracle(cells[n], oracle) for n in names]
            pct_oracle.extend(values)
            spread.append(statistics.pstdev(values))
            if base:
                mine = statistics.mean(cells[n]["hit_rate"] for n in names)
                points.append(100 * (mine - statistics.mean(cells[n]["hit_rate"] for n in base)))
            p90.extend(cells[n]["ttft_p90_ms"] / oracle["ttft_p90_ms"] for n in names if oracle["ttft_p90_ms"])
        out[family] = {
            "instances": len(names),
            "hit_pct_oracle": {"mean": statistics.mean(pct_oracle), "min": min(pct_oracle), "max": max(pct_oracle)},
            "within_sample_sd": statistics.mean(spread),
            "points_vs_prefix": {"mean": statistics.mean(points), "min": min(points), "max": max(points)}
            if points
            else None,
            "p90_x_oracle": statistics.mean(p90) if p90 else None,
        }
    return out


def print_ensemble(wname: str, level: str, ensemble: dict[str, Any], seeds: int) -> None:
    print(f"\n{wname} @ {level}: ring ensemble, over {seeds} seed(s) x ring instances")
    heads = f"{'hit % of oracle':>22} {'sd in sample':>12} {'pts vs prefix (per seed)':>26} {'p90 x orc':>9}"
    print(f"  {'family':<22} {'inst':>4} {heads}")
    for family, e in ensemble.items():
        h, d = e["hit_pct_oracle"], e["points_vs_prefix"]
        points = f"{d['mean']:+6.2f} [{d['min']:+5.1f}, {d['max']:+5.1f}]" if d else "-"
        p90 = f"{e['p90_x_oracle']:9.2f}" if e["p90_x_oracle"] is not None else f"{'-':>9}"
        print(f"  {family:<22} {e['instances']:4d} {h['mean']:6.1f} [{h['min']:5.1f}, {h['max']:5.1f}] "
              f"{e['within_sample_sd']:12.2f} {points:>26} {p90}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="append", help=f"default: {', '.join(DEFAULT_WORKLOADS)}")
    parser.add_argument("--load", action="append", choices=bp.LEVELS, help="default: both levels")
    parser.add_argument(
        "--variant", action="append", default=[], type=bp.parse_variant, help="NAME:POLICY[:key=value,...]"
    )
    parser.add_argument(
        "--hop-ms",
        type=float,
        default=0.0,
        help="the gateway's latency each way, in the real "
        "benchmark's wall milliseconds (default 0: placement alone); the oracle row gets none",
    )
    parser.add_argument("--hold", action="append", default=[], metavar="TOKENS[:FLEET]",
                        help="experiment: a `prefix` row whose requests wait at the gateway while their replica has "
                        "more than TOKENS prompt tokens queued for prefill (late binding) [and the replicas' mean "
                        "queue is over FLEET tokens]; repeatable")  # fmt: skip
    parser.add_argument("--no-peers", action="store_true", help="leave out least_loaded and sglang_like")
    parser.add_argument(
        "--precise",
        action="store_true",
        help="add the `precise` row (the simulated engines' KV events feed the gateway's precise index) and "
        "`prefix_aligned` (the same tokens, approximate model only)",
    )
    parser.add_argument(
        "--project",
        action="store_true",
        help="with --precise: add `precise_projected` (kv_events.project_evictions on, the shipped default; "
        "`precise` has it off)",
    )
    parser.add_argument("--flow", action="store_true",
                        help="add `prefix+flow` (flow control as shipped in front of `prefix`) and print issue 26's "
                        "verdict per workload and level (median over --seeds); with --precise --project also "
                        "`shipped` (precise projected routing behind flow control: every default)")  # fmt: skip
    parser.add_argument("--flow-variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="a flow-control row `prefix+NAME` with other settings (dotted keys for sections: "
                        "saturation.queued_prefill_tokens=8192); repeatable")  # fmt: skip
    parser.add_argument("--closed-loop", action="store_true",
                        help="a session's next request is sent no earlier than the previous one is answered (a "
                        "conversation's next turn resends that reply); default: the workload's own times (open "
                        "loop)")  # fmt: skip
    parser.add_argument("--kv", choices=sorted(KV_LEVELS), default="default",
                        help="per-replica KV cache size: default (bench_policies' 16,384 blocks) or tight (half: "
                        "the KV-pressure cell)")  # fmt: skip
    parser.add_argument("--block-size", type=int, default=None, metavar="TOKENS",
                        help="the engines' block size (default: bench_policies' 16); each cache keeps its size in "
                        "tokens, the routes follow the engines' size")  # fmt: skip
    parser.add_argument("--salts", type=int, default=1, metavar="N",
                        help="run every gateway row on N ring instances (the same rules, the ring's points hashed "
                        "with salts 1..N-1 as rows ROW~1..): hit rates then come with their spread between equally "
                        "valid placements of one sample, and settings are compared on family means")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=f"samples at {QUICK_SIZE} of the full size")
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="workload samples 0..N-1 (each a different set of "
        "sessions); the table's last block averages each row's ratios over them",
    )
    parser.add_argument("--first-seed", type=int, default=0, metavar="S",
                        help="start the samples at S (S..S+N-1): more samples of a cell without running the first "
                        "ones again")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for bench_virtual.json")
    args = parser.parse_args(argv)
    size = QUICK_SIZE if args.quick else 1.0
    global KV_FRACTION, ENGINE_BLOCK_SIZE
    KV_FRACTION = KV_LEVELS[args.kv]
    if args.block_size is not None and args.block_size < 1:
        parser.error("--block-size must be >= 1")
    if args.seeds < 1 or args.first_seed < 0:
        parser.error("--seeds must be >= 1 and --first-seed >= 0")
    ENGINE_BLOCK_SIZE = args.block_size
    levels = args.load or list(bp.LEVELS)
    variants = [(name, policy, dict(settings)) for name, policy, settings in args.variant]
    results: dict[str, Any] = {
        "size": size,
        "seeds": args.seeds,
        "first_seed": args.first_seed,
        "hop_ms": args.hop_ms,
        "closed_loop": args.closed_loop,
        "salts": args.salts,
        "kv": args.kv,
        "block_size": sim_options(False).block_size,
        "variants": {n: [p, s] for n, p, s in variants},
        "workloads": {},
    }
    for wname in args.workload or DEFAULT_WORKLOADS:
        results["workloads"][wname] = {}
        for level in levels:
            per_seed = []
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                wl = build(wname, size=size * bp.LEVEL_SIZE[level], seed=seed)
                extra = {"precise": args.precise, "project": args.project, "flow": args.flow}
                rows = rows_for(wl, variants, not args.no_peers, args.hold, args.salts, **extra,
                                flow_variants=args.flow_variant)  # fmt: skip
                cells = run_level(wl, level, rows, args.hop_ms, args.closed_loop)
                per_seed.append(cells)
                print_table(f"{wname} (seed {seed})", level, cells)
            summary = relative_summary(per_seed)
            ensemble = ensemble_summary(per_seed)
            medians = precise_medians(per_seed) if args.precise else {}
            results["workloads"][wname][level] = {"seeds": per_seed, "summary": summary, "ensemble": ensemble}
            if medians:
                results["workloads"][wname][level]["precise_medians"] = medians
            if args.flow:
                from benchmarks.virtual_flow import print_verdict, verdict

                judged = results["workloads"][wname][level]["flow_verdict"] = verdict(per_seed, level)
                print_verdict(wname, level, judged)
            if args.seeds > 1:
                print_summary(wname, level, summary)
                if medians:
                    print_precise_medians(wname, level, medians)
            if ensemble:
                print_ensemble(wname, level, ensemble, args.seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_virtual.json"
    path.write_text(json.dumps(results, indent=1, sort_keys=True))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
