"""``prefix_gateway_kv_events_*``: each replica's routing mode and its event feed, read at scrape time.

The check that events arrive: ``prefix_gateway_kv_events_mode{replica, mode="precise"}`` is
1 and ``..._messages_total`` grows while the replica serves traffic.  Labels are bounded:
replica names, modes, the fixed reason lists of the decoder, feeds and index.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.kv_events.service import KvEvents


class KvEventsCollector(Collector):
    """Reads :class:`KvEvents` when Prometheus scrapes; the hot path pays nothing."""

    def __init__(self, events: KvEvents) -> None:
        self._events = events

    def collect(self) -> Iterable[Metric]:
        p = "prefix_gateway_kv_events_"
        events = self._events
        mode = GaugeMetricFamily(
            p + "mode",
            "1 for the replica's routing mode: precise (matched from its engine's KV events) or approximate "
            "(the gateway's model of its cache)",
            labels=["replica", "mode"],
        )
        why_approximate = GaugeMetricFamily(
            p + "approximate_reason",
            "1 for why a replica is routed by the approximate model",
            labels=["replica", "reason"],
        )
        messages = CounterMetricFamily(p + "messages", "KV event messages received and applied", labels=["replica"])
        decoded = CounterMetricFamily(p + "events", "KV events decoded from those messages", labels=["replica"])
        dropped = CounterMetricFamily(
            p + "dropped", "Messages that could not be decoded, by reason", labels=["replica", "reason"]
        )
        gaps = CounterMetricFamily(p + "gaps", "Sequence gaps (missed messages)", labels=["replica"])
        replays = CounterMetricFamily(
            p + "replays", "Gap replays over the replica's replay socket", labels=["replica", "outcome"]
        )
        restarts = CounterMetricFamily(
            p + "restarts", "Sequences that went backwards (engine restarts)", labels=["replica"]
        )
        blocks = GaugeMetricFamily(
            p + "indexed_blocks", "Blocks the precise index holds for the replica", labels=["replica"]
        )
        for name in events.replicas():
            current, reason = events.mode_of(name)
            for value in ("precise", "approximate"):
                mode.add_metric([name, value], 1.0 if value == current else 0.0)
            if reason is not None:
                why_approximate.add_metric([name, reason], 1.0)
            feed = events.ingestor.feeds.get(name)
            blocks.add_metric([name], events.index.blocks(name))
            if feed is None:
                continue
            messages.add_metric([name], feed.messages)
            decoded.add_metric([name], feed.events)
            for why, count in feed.dropped.items():
                dropped.add_metric([name, why], count)
            gaps.add_metric([name], feed.gaps)
            for outcome, count in feed.replays.items():
                replays.add_metric([name, outcome], count)
            restarts.add_metric([name], feed.restarts)
        skipped = CounterMetricFamily(
            p + "skipped_blocks", "Events (or their blocks) the index did not keep, by reason", labels=["reason"]
        )
        for why, count in events.index.skipped.items():
            skipped.add_metric([why], count)
        memory = GaugeMetricFamily(
            p + "index_bytes", "Bytes the precise index budgets (bounded by kv_events.max_bytes)"
        )
        memory.add_metric([], events.index.memory_bytes())
        evicted = CounterMetricFamily(p + "index_evicted", "Entries the precise index dropped at its memory bound")
        evicted.add_metric([], events.index.evicted)
        yield from (
            mode,
            why_approximate,
            messages,
            decoded,
            dropped,
            gaps,
            replays,
            restarts,
            blocks,
            skipped,
            memory,
            evicted,
        )


__all__ = ["KvEventsCollector"]
