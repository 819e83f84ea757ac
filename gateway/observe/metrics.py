"""Prometheus metrics (``prefix_gateway_*``) on a per-gateway registry.

Labels are bounded: route, replica, endpoint, status class, policy, policy branch (reason),
normalization rule and mode, error kind — never a prompt, a hash or a request id.
Request counters are updated once per finished request from an ``Outcome``; live state
(in-flight, health, scraped engine numbers) is read at scrape time by a collector, so the
hot path pays nothing for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.http.capacity import Capacity
from gateway.observe.outcome import Outcome
from gateway.prefix.normalize import Normalizer
from gateway.replicas.pool import Replica
from gateway.state.affinity_sync import SyncStats

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    """All gateway metrics; one instance per ``Gateway`` (tests run several in a process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "prefix_gateway_"
        self.requests = Counter(
            p + "requests", "Finished requests", ["route", "replica", "endpoint", "status_class"], registry=r
        )
        self.errors = Counter(p + "errors", "Requests that failed, by kind", ["route", "kind"], registry=r)
        self.decisions = Counter(
            p + "decisions", "Routing decisions by policy branch", ["route", "policy", "reason"], registry=r
        )
        self.retries = Counter(p + "retries", "Retries on another replica before any byte", ["route"], registry=r)
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens from responses' usage", ["route", "replica"], registry=r
        )
        self.completion_tokens = Counter(
            p + "completion_tokens", "Completion tokens from responses' usage", ["route", "replica"], registry=r
        )
        self.cached_tokens = Counter(
            p + "cached_tokens",
            "usage.prompt_tokens_details.cached_tokens reported by replicas",
            ["route", "replica"],
            registry=r,
        )
        self.cache_reported_prompt_tokens = Counter(
            p + "cache_reported_prompt_tokens",
            "Prompt tokens of responses that reported cached_tokens (the hit-rate denominator)",
            ["route", "replica"],
            registry=r,
        )
        self.predicted_cached_tokens = Counter(
            p + "predicted_cached_tokens",
            "Cached prompt tokens the routing policy predicted (prefix policy), answered requests",
            ["route", "replica"],
            registry=r,
        )
        self.predicted_prompt_tokens = Counter(
            p + "predicted_prompt_tokens",
            "Prompt tokens of the answered requests that had a prediction (the predicted hit-rate denominator)",
            ["route", "replica"],
            registry=r,
        )
        self.prediction_error_tokens = Counter(
            p + "prediction_error_tokens",
            "|predicted - reported cached tokens| of answered requests that had both, by direction (over: "
            "predicted more than the engine hit); divided by prediction_checked_prompt_tokens: the mean "
            "prediction error per prompt token",
            ["route", "replica", "direction"],
            registry=r,
        )
        self.prediction_checked_prompt_tokens = Counter(
            p + "prediction_checked_prompt_tokens",
            "Prompt tokens of the answered requests that had a prediction and reported cached_tokens",
            ["route", "replica"],
            registry=r,
        )
        self.normalize_spans = Counter(
            p + "normalize_spans",
            "Volatile spans found (report) or moved (relocate)",
            ["route", "rule", "mode"],
            registry=r,
        )
        self.added_latency = Histogram(
            p + "added_latency_seconds",
            "Time spent in the gateway itself (before the upstream call + after its answer)",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            p + "ttft_seconds",
            "Time to first streamed byte, as the client sees it",
            ["route"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            p + "request_duration_seconds",
            "End-to-end request time",
            ["route", "endpoint"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.route_info = Gauge(p + "route_info", "Configured routes", ["route", "policy"], registry=r)
        self.route_replica_info = Gauge(
            p + "route_replica_info",
            "Replicas in each route's pool (join engine series per replica to routes)",
            ["route", "replica"],
            registry=r,
        )
        ProcessCollector(registry=r)
        self._children: dict[tuple[Any, ...], Any] = {}

    def declare_route(self, route: str, policy: str, replicas: Iterable[str]) -> None:
        """A configured route and its pool (so per-route engine hit rates can be queried)."""
        self.route_info.labels(route, policy).set(1)
        for replica in replicas:
            self.route_replica_info.labels(route, replica).set(1)

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def record(self, o: Outcome) -> None:
        """Update every per-request metric from one outcome."""
        route = o.route
        replica = o.replica or "none"
        c = self._child
        c(self.requests, route, replica, o.endpoint, o.status_class).inc()
        c(self.duration, route, o.endpoint).observe(o.duration_s)
        if o.error_kind:
            c(self.errors, route, o.error_kind).inc()
        if o.reason and o.policy:
            c(self.decisions, route, o.policy, o.reason).inc()
        if o.retries:
            c(self.retries, route).inc(o.retries)
        if o.added_s is not None:
            c(self.added_latency, route).observe(o.added_s)
        if o.ttft_s is not None:
            c(self.ttft, route).observe(o.ttft_s)
        if o.prompt_tokens:
            c(self.prompt_tokens, route, replica).inc(o.prompt_tokens)
            if o.cached_tokens is not None:
                c(self.cache_reported_prompt_tokens, route, replica).inc(o.prompt_tokens)
                c(self.cached_tokens, route, replica).inc(o.cached_tokens)
            if o.predicted_cached_tokens is not None:
                c(self.predicted_prompt_tokens, route, replica).inc(o.prompt_tokens)
                c(self.predicted_cached_tokens, route, replica).inc(o.predicted_cached_tokens)
                miss = o.prediction_miss
                if miss is not None:
                    direction = "over" if miss > 0 else "under"
                    c(self.prediction_error_tokens, route, replica, direction).inc(abs(miss))
                    c(self.prediction_checked_prompt_tokens, route, replica).inc(o.prompt_tokens)
        if o.completion_tokens:
            c(self.completion_tokens, route, replica).inc(o.completion_tokens)
        if o.normalized and o.normalize_mode:
            for rule, count in o.normalized.items():
                c(self.normalize_spans, route, rule, o.normalize_mode).inc(count)


class ReplicaCollector(Collector):
    """Live per-replica state, read at scrape time (no hot-path cost)."""

    def __init__(self, replicas: Callable[[], Sequence[Replica]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterable[Metric]:
        p = "prefix_gateway_"
        in_flight = GaugeMetricFamily(p + "replica_in_flight", "Requests in flight per replica", labels=["replica"])
        pending = GaugeMetricFamily(
            p + "replica_pending_prefill_tokens",
            "Uncached prompt tokens of requests sent to the replica that have no first byte yet (estimated)",
            labels=["replica"],
        )
        healthy = GaugeMetricFamily(p + "replica_healthy", "1 if the replica takes traffic", labels=["replica"])
        changes = CounterMetricFamily(p + "replica_health_changes", "Health state transitions", labels=["replica"])
        restarts = CounterMetricFamily(
            p + "replica_restarts_detected",
            "Times the replica looked restarted: engine counters went backwards (counters_reset) or it "
            "returned to healthy (rejoined)",
            labels=["replica", "cause"],
        )
        outlier = {
            "ejections_total": CounterMetricFamily(
                p + "replica_ejections", "Ejections by outlier detection (real traffic)", labels=["replica"]
            ),
            "eject_denied": CounterMetricFamily(
                p + "replica_eject_denied",
                "Ejections refused because the fleet's ejected share was at max_ejected_percent",
                labels=["replica"],
            ),
            "failures_total": CounterMetricFamily(
                p + "replica_passive_failures",
                "Failed real requests counted by outlier detection (5xx, transport, stalls)",
                labels=["replica"],
            ),
            "passive_recoveries": CounterMetricFamily(
                p + "replica_passive_recoveries",
                "Times a down replica came back because a real request succeeded (panic traffic)",
                labels=["replica"],
            ),
            "cancelled_on_down": CounterMetricFamily(
                p + "replica_cancelled_on_down",
                "Requests that stopped waiting for the replica when it went down and moved on",
                labels=["replica"],
            ),
        }
        ejected = GaugeMetricFamily(
            p + "replica_ejected", "1 while the replica is ejected by outlier detection", labels=["replica"]
        )
        slow = GaugeMetricFamily(
            p + "replica_slow", "1 while the replica is deprioritized as slow (time to first byte)", labels=["replica"]
        )
        ttfb = GaugeMetricFamily(
            p + "replica_ttfb_ewma_seconds", "Smoothed time to first byte of streams", labels=["replica"]
        )
        gauges = {
            "kv_cache_usage": GaugeMetricFamily(
                p + "engine_kv_cache_usage", "Scraped vllm:kv_cache_usage_perc (0-1)", labels=["replica"]
            ),
            "running": GaugeMetricFamily(
                p + "engine_requests_running", "Scraped vllm:num_requests_running", labels=["replica"]
            ),
            "waiting": GaugeMetricFamily(
                p + "engine_requests_waiting", "Scraped vllm:num_requests_waiting", labels=["replica"]
            ),
        }
        counters = {
            "prefix_cache_queries": CounterMetricFamily(
                p + "engine_prefix_cache_queries",
                "Scraped vllm:prefix_cache_queries_total (tokens)",
                labels=["replica"],
            ),
            "prefix_cache_hits": CounterMetricFamily(
                p + "engine_prefix_cache_hits", "Scraped vllm:prefix_cache_hits_total (tokens)", labels=["replica"]
            ),
            "preemptions": CounterMetricFamily(
                p + "engine_preemptions", "Scraped vllm:num_preemptions_total", labels=["replica"]
            ),
            "prompt_tokens": CounterMetricFamily(
                p + "engine_prompt_tokens", "Scraped vllm:prompt_tokens_total", labels=["replica"]
            ),
            "generation_tokens": CounterMetricFamily(
                p + "engine_generation_tokens", "Scraped vllm:generation_tokens_total", labels=["replica"]
            ),
        }
        age = GaugeMetricFamily(
            p + "engine_scrape_age_seconds", "Seconds since the last good scrape", labels=["replica"]
        )
        now = time.monotonic()
        for replica in self._replicas():
            name = [replica.name]
            in_flight.add_metric(name, replica.in_flight)
            pending.add_metric(name, replica.pending_prefill_tokens)
            healthy.add_metric(name, 1.0 if replica.healthy else 0.0)
            changes.add_metric(name, replica.health_changes)
            for cause, count in replica.restarts_detected.items():
                restarts.add_metric([replica.name, cause], count)
            for field, family in outlier.items():
                family.add_metric(name, getattr(replica, field))
            ejected.add_metric(name, 1.0 if replica.ejected_until > now and not replica.healthy else 0.0)
            slow.add_metric(name, 1.0 if replica.slow else 0.0)
            if replica.ttfb_ewma is not None:
                ttfb.add_metric(name, replica.ttfb_ewma)
            engine = replica.engine
            if engine is None:
                continue
            age.add_metric(name, now - engine.scraped_at)
            for field, family in (*gauges.items(), *counters.items()):
                value = getattr(engine, field)
                if value is not None:
                    family.add_metric(name, value)
        yield in_flight
        yield pending
        yield healthy
        yield changes
        yield restarts
        yield from outlier.values()
        yield ejected
        yield slow
        yield ttfb
        yield age
        yield from gauges.values()
        yield from counters.values()


class RouteCollector(Collector):
    """Per-route panic mode (healthy share below the threshold) and the prefix policy's KV cache
    model, read at scrape time."""

    def __init__(self, routes: Callable[[], Sequence[tuple[str, Any]]]) -> None:
        self._routes = routes  # (route name, its PolicyRunner)

    def collect(self) -> Iterable[Metric]:
        p = "prefix_gateway_"
        panic = GaugeMetricFamily(
            p + "route_panic", "1 while the route routes over all replicas (panic mode)", labels=["route"]
        )
        decisions = CounterMetricFamily(p + "route_panic_decisions", "Decisions made in panic mode", labels=["route"])
        kv_model = GaugeMetricFamily(
            p + "kv_model_tokens",
            "The prefix policy's model of each replica's KV cache (replica_cache_tokens), in prompt tokens: "
            "its size (kind=capacity) and what it holds now (kind=held)",
            labels=["route", "replica", "kind"],
        )
        for name, runner in self._routes():
            panic.add_metric([name], 1.0 if runner.in_panic() else 0.0)
            decisions.add_metric([name], runner.panic_decisions)
            caches = getattr(getattr(runner.policy, "index", None), "modelled_caches", None)
            for replica, (capacity, held) in (caches() if callable(caches) else {}).items():
                kv_model.add_metric([name, replica, "capacity"], capacity)
                kv_model.add_metric([name, replica, "held"], held)
        yield panic
        yield decisions
        yield kv_model


class SyncCollector(Collector):
    """Affinity sharing between gateway processes (``state.backend: redis``), read at scrape time."""

    def __init__(self, stats: SyncStats) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        p = "prefix_gateway_state_sync_"
        stats = self._stats
        connected = GaugeMetricFamily(p + "connected", "1 while the Redis channel is subscribed")
        connected.add_metric([], 1.0 if stats.connected else 0.0)
        records = CounterMetricFamily(
            p + "records",
            "Affinity records: published (ours), applied (peers'), ignored (unknown route/replica), dropped (unsent), "
            "withdrawn (ours taken back and sent: the replica did not serve), withdrawals_applied (peers'), "
            "oversize (a peer's, more keys than a max_body_bytes prompt makes)",
            labels=["outcome"],
        )
        for outcome in ("published", "applied", "ignored", "dropped", "withdrawn", "withdrawals_applied", "oversize"):
            records.add_metric([outcome], getattr(stats, outcome))
        sightings = CounterMetricFamily(
            p + "sightings_dropped",
            "Conversation starts and normalization places never published (a failed publish)",
        )
        sightings.add_metric([], stats.dropped_sightings)
        replayed = CounterMetricFamily(
            p + "replayed", "Signed peer messages refused as replays (a sequence already heard, state.secret_env)"
        )
        replayed.add_metric([], stats.replayed)
        errors = CounterMetricFamily(p + "errors", "Failed Redis calls and malformed messages")
        errors.add_metric([], stats.errors)
        rejected = CounterMetricFamily(
            p + "rejected", "Peer messages dropped for a missing, wrong or stale signature (state.secret_env)"
        )
        rejected.add_metric([], stats.rejected)
        peers = GaugeMetricFamily(p + "peers", "Other gateway processes whose load reports are current")
        peers.add_metric([], stats.peers)
        snapshots = CounterMetricFamily(
            p + "snapshots_heard", "Catch-up snapshots peers finished sending (to a gateway process that joined)"
        )
        snapshots.add_metric([], stats.snapshots_heard)
        yield connected
        yield records
        yield errors
        yield rejected
        yield replayed
        yield sightings
        yield peers
        yield snapshots


class LimitsCollector(Collector):
    """Per-key limits and their Redis circuit breaker, read at scrape time.

    ``snapshot`` is ``KeyLimiter.snapshot`` (duck-typed: this module imports no limits code)."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        p = "prefix_gateway_limits_"
        snap = self._snapshot()
        refused = CounterMetricFamily(p + "refused", "Requests answered 429 by per-key limits", labels=["limit"])
        for limit, count in snap.get("refused", {}).items():
            refused.add_metric([limit], count)
        fallbacks = CounterMetricFamily(
            p + "redis_fallbacks",
            "Limit checks answered from this process's tables because Redis failed or was skipped",
        )
        fallbacks.add_metric([], snap.get("redis_fallbacks", 0))
        yield refused
        yield fallbacks
        breaker = snap.get("redis_breaker")
        if not breaker:
            return
        state = GaugeMetricFamily(p + "redis_breaker_open", "1 while Redis is skipped after a failure (probed by PING)")
        state.add_metric([], 1.0 if breaker["state"] == "open" else 0.0)
        trips = CounterMetricFamily(p + "redis_breaker_trips", "Times the limits' Redis breaker opened")
        trips.add_metric([], breaker["trips"])
        skipped = CounterMetricFamily(p + "redis_skipped", "Limit calls not sent to Redis because the breaker was open")
        skipped.add_metric([], breaker["skipped"])
        lost = snap.get("lost_slots", {})
        freed = CounterMetricFamily(
            p + "lost_slots_freed", "Redis concurrency slots whose reply or release was lost, removed once it answered"
        )
        freed.add_metric([], lost.get("freed", 0))
        yield state
        yield trips
        yield skipped
        yield freed


class MembershipCollector(Collector):
    """Discovery sources, draining replicas and config reloads, read at scrape time.

    ``membership`` is duck-typed (``gateway.discovery.membership.Membership``: ``sources``, ``draining``,
    ``drained``) and ``reloads`` a mapping outcome -> count, so this module imports neither.
    """

    def __init__(self, membership: Any, reloads: Callable[[], dict[str, int]]) -> None:
        self._membership = membership
        self._reloads = reloads

    def collect(self) -> Iterable[Metric]:
        p = "prefix_gateway_"
        m = self._membership
        labels = ["source", "kind"]
        replicas = GaugeMetricFamily(p + "discovery_replicas", "Replicas a discovery source reports now", labels=labels)
        up = GaugeMetricFamily(
            p + "discovery_up", "1 unless the source's last lookup or API call failed", labels=labels
        )
        updates = CounterMetricFamily(p + "discovery_updates", "Answers received from the source", labels=labels)
        errors = CounterMetricFamily(p + "discovery_errors", "Failed lookups or API calls", labels=labels)
        changes = CounterMetricFamily(
            p + "discovery_changes", "Replicas that joined or left through the source", labels=[*labels, "change"]
        )
        for name, stats in m.sources.items():
            key = [name, stats.kind]
            replicas.add_metric(key, stats.replicas)
            up.add_metric(key, 0.0 if stats.failing else 1.0)
            updates.add_metric(key, stats.updates)
            errors.add_metric(key, stats.errors)
            changes.add_metric([*key, "added"], stats.added)
            changes.add_metric([*key, "removed"], stats.removed)
        draining = GaugeMetricFamily(
            p + "replicas_draining", "Replicas that left their pools and still finish running requests"
        )
        draining.add_metric([], len(m.draining))
        drained = CounterMetricFamily(p + "replicas_drained", "Replicas that left and finished draining")
        drained.add_metric([], m.drained)
        reloads = CounterMetricFamily(
            p + "config_reloads", "Config reloads (SIGHUP or file change) by outcome", labels=["outcome"]
        )
        for outcome, count in sorted(self._reloads().items()):
            reloads.add_metric([outcome], count)
        yield from (replicas, up, updates, errors, changes, draining, drained, reloads)


class NormalizationCollector(Collector):
    """Per-route learning of normalization (issue 9), read at scrape time (no hot-path cost).

    ``normalizers`` yields (route, normalizer) for routes that normalize.
    """

    def __init__(self, normalizers: Callable[[], Iterable[tuple[str, Normalizer]]]) -> None:
        self._normalizers = normalizers

    def collect(self) -> Iterable[Metric]:
        p = "prefix_gateway_normalize_"
        warmup = CounterMetricFamily(
            p + "warmup_misses",
            "Requests that kept a volatile value in place before it was known to vary (learned or discovered)",
            labels=["route"],
        )
        learned = GaugeMetricFamily(
            p + "learned_places",
            "Places currently known to vary (detector places and discovered rules)",
            labels=["route"],
        )
        static = CounterMetricFamily(
            p + "static_spans",
            "Detected spans left in place: never seen changing (static) or in code/JSON",
            labels=["route", "reason"],
        )
        for route, normalizer in self._normalizers():
            discoverer = normalizer.discoverer
            warmup.add_metric(
                [route], normalizer.learner.warmup_misses + (discoverer.warmup_misses if discoverer else 0)
            )
            varying = sum(1 for place in normalizer.learner.places() if place.varies)
            learned.add_metric([route], varying + (len(discoverer.rules()) if discoverer else 0))
            rows = list(normalizer.tally.values())
            static.add_metric([route, "static"], sum(r[2] for r in rows))
            static.add_metric([route, "protected"], sum(r[3] for r in rows))
        yield warmup
        yield learned
        yield static


class WarmupCollector(Collector):
    """Warm restarts (``gateway.replicas.warmup``): hot-set sizes and replays, read at scrape time.

    ``warmer`` is duck-typed (``sets``, ``stats``, ``running()``) so this module imports no replica code.
    """

    def __init__(self, warmer: Any) -> None:
        self._warmer = warmer

    def collect(self) -> Iterable[Metric]:
        p = "prefix_gateway_warmup_"
        w = self._warmer
        prefixes = GaugeMetricFamily(
            p + "hot_prefixes", "Prefixes remembered to replay, per route and replica", labels=["route", "replica"]
        )
        size = GaugeMetricFamily(
            p + "hot_prefix_bytes", "Request-body bytes remembered to replay", labels=["route", "replica"]
        )
        for (route, replica), hot in sorted(w.sets.items()):
            prefixes.add_metric([route, replica], len(hot))
            size.add_metric([route, replica], hot.bytes)
        runs = CounterMetricFamily(p + "runs", "Warm-ups started, by replica", labels=["replica"])
        replays = CounterMetricFamily(
            p + "requests", "Warm-up replays (max_tokens 1) by outcome", labels=["replica", "outcome"]
        )
        skipped = CounterMetricFamily(
            p + "skipped",
            "Restart signals that started no warm-up (cooldown, already running)",
            labels=["replica", "reason"],
        )
        prompt = CounterMetricFamily(
            p + "prompt_tokens",
            "Prompt tokens of warm-up replays (in the engine's counters, not in ours)",
            labels=["replica"],
        )
        cached = CounterMetricFamily(
            p + "cached_tokens", "Of which already cached at the replica when replayed", labels=["replica"]
        )
        for name, stats in sorted(w.stats.items()):
            runs.add_metric([name], stats.runs)
            for outcome, count in stats.replays.items():
                replays.add_metric([name, outcome], count)
            for reason, count in stats.skipped.items():
                skipped.add_metric([name, reason], count)
            prompt.add_metric([name], stats.prompt_tokens)
            cached.add_metric([name], stats.cached_tokens)
        running = GaugeMetricFamily(p + "running", "Warm-ups in progress")
        running.add_metric([], len(w.running()))
        yield from (prefixes, size, runs, replays, skipped, prompt, cached, running)


class CapacityCollector(Collector):
    """The process-wide caps of the proxied path (``gateway.http.capacity``), read at scrape time.

    Sheds are also counted per request in ``errors_total{kind="overloaded"}``; these say how
    close to the caps the process runs, and which cap shed.
    """

    def __init__(self, capacity: Capacity, server: Callable[[], Any]) -> None:
        self._capacity = capacity
        self._server = server  # the live ``server:`` settings (caps change on reload)

    def collect(self) -> Iterable[Metric]:
        p = "prefix_gateway_"
        c, server = self._capacity, self._server()
        in_flight = GaugeMetricFamily(p + "in_flight", "Proxied requests in flight in this process (all routes)")
        in_flight.add_metric([], c.in_flight)
        max_in_flight = GaugeMetricFamily(p + "max_concurrency", "server.max_concurrency: the cap on in_flight")
        max_in_flight.add_metric([], server.max_concurrency)
        buffered = GaugeMetricFamily(
            p + "buffered_body_bytes", "Request-body bytes reserved by the proxied requests in flight"
        )
        buffered.add_metric([], c.buffered_bytes)
        max_buffered = GaugeMetricFamily(
            p + "max_buffered_body_bytes", "server.max_buffered_body_bytes: the cap on buffered_body_bytes"
        )
        max_buffered.add_metric([], server.max_buffered_body_bytes)
        shed = CounterMetricFamily(p + "shed", "Requests answered 503 server_overloaded, by cap", labels=["cap"])
        for cap, count in sorted(c.shed.items()):
            shed.add_metric([cap], count)
        yield from (in_flight, max_in_flight, buffered, max_buffered, shed)
