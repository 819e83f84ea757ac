"""vLLM's periodic engine log line, in its exact format.

``Engine 000: Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s,
Running: N reqs, Waiting: M reqs, GPU KV cache usage: Z%, Prefix cache hit rate: H%``

(``CPU KV cache usage`` with ``device="cpu"``, as vLLM's CPU backend writes it.)

Like vLLM, an idle engine's line (zero throughput now and in the previous interval) is
logged at DEBUG, so a quiet replica does not fill the log.  The hit rate covers the most
recent requests (vLLM's ``PrefixCachingMetrics`` window), not the whole lifetime.
"""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.sim.engine import Engine

logger = logging.getLogger("gateway.sim.stats")

ENGINE_INDEX = 0


class StatsLogger:
    def __init__(self, engine: Engine, interval_s: float) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.device = "CPU" if engine.options.device == "cpu" else "GPU"
        self._last_time = time.monotonic()
        self._last_prompt = engine.total_prompt_tokens
        self._last_generation = engine.total_generation_tokens
        self._last_throughputs = (0.0, 0.0)

    def format_line(self, now: float | None = None) -> tuple[int, str]:
        """Return (log level, message) for the interval ending now, and start a new interval."""
        engine = self.engine
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        prompt = engine.total_prompt_tokens - self._last_prompt
        generation = engine.total_generation_tokens - self._last_generation
        prompt_tps = prompt / elapsed if elapsed > 0 else 0.0
        generation_tps = generation / elapsed if elapsed > 0 else 0.0
        level = logging.INFO if any((prompt_tps, generation_tps, *self._last_throughputs)) else logging.DEBUG
        self._last_time = now
        self._last_prompt = engine.total_prompt_tokens
        self._last_generation = engine.total_generation_tokens
        self._last_throughputs = (prompt_tps, generation_tps)
        message = (
            f"Engine {ENGINE_INDEX:03d}: "
            f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {generation_tps:.1f} tokens/s, "
            f"Running: {engine.num_running} reqs, Waiting: {engine.num_waiting} reqs, "
            f"{self.device} KV cache usage: {engine.cache.usage * 100:.1f}%, "
            f"Prefix cache hit rate: {engine.recent_hit_rate * 100:.1f}%"
        )
        return level, message

    def log(self) -> None:
        level, message = self.format_line()
        logger.log(level, message)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.log()
