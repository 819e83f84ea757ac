"""The periodic per-route summary line, in the spirit of vLLM's engine stats line.

Every ``summary_interval_s`` seconds, for each route that saw traffic (or has requests in
flight), one line of ``Key: value`` pairs separated by ", " — parse it key by key:

    Route chat: Request rate: 12.3 req/s, Prompt throughput: 4512.0 tokens/s,
    Generation throughput: 320.0 tokens/s, Prefix cache hit rate: 78.1%,
    Predicted hit rate: 80.3%, Engine hit rate: 75.0%, TTFT p50: 42.0 ms, TTFT p90: 130.0 ms,
    Healthy replicas: 4/4, In-flight max: 3, In-flight mean: 1.25, Errors: 0

(one line in the log).  Unknown values read ``n/a``.  The engine hit rate is the change of
the route's replicas' scraped ``vllm:prefix_cache_hits_total / queries_total`` over the
window (replicas shared by several routes count for each); the first line's window starts
at the gateway's first scrape of each replica, not at the replica's own start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from gateway.observe.logs import SUMMARY_LOGGER
from gateway.observe.stats import StatsBook, percentile
from gateway.replicas.pool import Replica
from gateway.tasks import cancel_and_wait

log = logging.getLogger(SUMMARY_LOGGER)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f}%"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.1f} ms"


class SummaryReporter:
    def __init__(
        self,
        stats: StatsBook,
        routes: Callable[[], Sequence[tuple[str, Sequence[Replica]]]],
        interval_s: float,
    ) -> None:
        self.stats = stats
        self.routes = routes
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._engine_seen: dict[str, tuple[float, float]] = {}  # replica -> (hits, queries) at last line
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="summary")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                for line in self.lines():
                    log.info(line[0], extra={"fields": line[1]})
            except Exception:
                log.exception("summary line failed")

    def _engine_delta(self, replicas: Sequence[Replica], seen: dict[str, tuple[float, float]]) -> float | None:
        hits = queries = 0.0
        for replica in replicas:
            engine = replica.engine
            if engine is None or engine.prefix_cache_hits is None or engine.prefix_cache_queries is None:
                continue
            # the first line's window starts at the gateway's first scrape, not the engine's start
            before = self._engine_seen.get(replica.name) or replica.engine_baseline or (0.0, 0.0)
            seen[replica.name] = (engine.prefix_cache_hits, engine.prefix_cache_queries)
            dh, dq = engine.prefix_cache_hits - before[0], engine.prefix_cache_queries - before[1]
            if dq < 0 or dh < 0:  # the replica restarted: its counters did too
                dh, dq = engine.prefix_cache_hits, engine.prefix_cache_queries
            hits += dh
            queries += dq
        return hits / queries if queries > 0 else None

    def lines(self, now: float | None = None) -> list[tuple[str, dict[str, Any]]]:
        """Build (and reset the windows of) this period's lines: ``(text, structured fields)``."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._last_time, 1e-9)
        self._last_time = now
        seen: dict[str, tuple[float, float]] = {}
        out = []
        for route, replicas in self.routes():
            window = self.stats.take_window(route)
            engine_rate = self._engine_delta(replicas, seen)
            in_flight = [r.in_flight for r in replicas]
            t = window.tally
            if t.requests == 0 and not any(in_flight):
                continue
            healthy = sum(1 for r in replicas if r.healthy)
            fields: dict[str, Any] = {
                "route": route,
                "request_rate": round(t.requests / elapsed, 3),
                "prompt_throughput": round(t.prompt_tokens / elapsed, 1),
                "generation_throughput": round(t.completion_tokens / elapsed, 1),
                "hit_rate_reported": t.hit_rate_reported,
                "hit_rate_predicted": t.hit_rate_predicted,
                "predicted_units": t.predicted_units,
                "prediction_error": t.prediction_error,
                "hit_rate_engine": engine_rate,
                "ttft_p50_s": percentile(window.ttft, 50),
                "ttft_p90_s": percentile(window.ttft, 90),
                "healthy_replicas": healthy,
                "replicas": len(replicas),
                "in_flight_max": max(in_flight, default=0),
                "in_flight_mean": round(sum(in_flight) / len(in_flight), 3) if in_flight else 0.0,
                "errors": t.errors,
            }
            text = (
                f"Route {route}: Request rate: {fields['request_rate']:.1f} req/s, "
                f"Prompt throughput: {fields['prompt_throughput']:.1f} tokens/s, "
                f"Generation throughput: {fields['generation_throughput']:.1f} tokens/s, "
                f"Prefix cache hit rate: {_pct(t.hit_rate_reported)}, "
                f"Predicted hit rate: {_pct(t.hit_rate_predicted)}, "
                + (f"Predicted units: {t.predicted_units}, " if t.predicted_units and not t.predicted_exact else "")
                + f"Engine hit rate: {_pct(engine_rate)}, "
                f"TTFT p50: {_ms(fields['ttft_p50_s'])}, TTFT p90: {_ms(fields['ttft_p90_s'])}, "
                f"Healthy replicas: {healthy}/{len(replicas)}, "
                f"In-flight max: {fields['in_flight_max']}, In-flight mean: {fields['in_flight_mean']:.2f}, "
                f"Errors: {t.errors}"
            )
            out.append((text, fields))
        self._engine_seen.update(seen)
        return out
