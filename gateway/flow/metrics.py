"""Flow control's Prometheus series: per route, band and flow, the flow label bounded.

A flow is a tenant (a fairness header's value, a hashed API key, or the route): unbounded
as a label.  :class:`FlowLabels` names the first ``flow_label_limit`` flows a route sees
(never a raw key: API keys are flows as the first 16 hex of their sha256) and counts every
later one as ``other`` — first come rather than top-N, so a flow's series never changes
label mid-life and counters stay monotonic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: what happened to a request flow control held (or refused to)
EVENTS = ("queued", "dispatched", "shed", "refused", "expired", "cancelled", "unplaceable")
OTHER = "other"


class FlowLabels:
    """Flow id -> bounded metric label (per route)."""

    __slots__ = ("limit", "named")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.named: set[str] = set()

    def __call__(self, flow: str) -> str:
        if flow in self.named:
            return flow
        if len(self.named) < self.limit:
            self.named.add(flow)
            return flow
        return OTHER


class FlowMetrics:
    """The counters and histogram the request path updates; depths are read at scrape time."""

    def __init__(self, registry: CollectorRegistry, snapshot: Callable[[], dict[str, Any]]) -> None:
        p = "prefix_gateway_flow_"
        self.events = Counter(
            p + "requests",
            "Requests flow control held or refused, by what happened (queued, dispatched, shed, refused: "
            "queue full, expired: TTL, cancelled: the client left, unplaceable: no replica)",
            ["route", "band", "flow", "event"],
            registry=registry,
        )
        self.wait = Histogram(
            p + "wait_seconds",
            "Time dispatched requests waited in the gateway's queue",
            ["route", "band", "flow"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        registry.register(_DepthCollector(snapshot))

    def count(self, route: str, band: int, flow: str, event: str) -> None:
        self.events.labels(route, str(band), flow, event).inc()

    def waited(self, route: str, band: int, flow: str, seconds: float) -> None:
        self.wait.labels(route, str(band), flow).observe(seconds)


class _DepthCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        p = "prefix_gateway_flow_"
        depth = GaugeMetricFamily(p + "queue_depth", "Requests queued now", labels=["route", "band", "flow"])
        held = GaugeMetricFamily(p + "queue_bytes", "Request bytes queued now", labels=["route", "band"])
        saturated = GaugeMetricFamily(
            p + "route_saturated", "1 while no eligible replica of the route has room", labels=["route"]
        )
        for route, state in self._snapshot().items():
            saturated.add_metric([route], 1.0 if state["saturated"] else 0.0)
            for band, info in state["bands"].items():
                held.add_metric([route, str(band)], info["bytes"])
                for flow, n in info["flow_labels"].items():
                    depth.add_metric([route, str(band), flow], n)
        yield depth
        yield held
        yield saturated
