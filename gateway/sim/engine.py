"""Continuous batching in simulated steps, shaped like vLLM v1's scheduler.

Each step (one asyncio task per replica):

1. running requests first, in arrival order: a request computes every token it has not
   computed yet (its prompt, chunked to the step's token budget, then one token per step
   while decoding); blocks for the new tokens are allocated now, and when the pool is
   exhausted the *last* running request is preempted (recompute mode: it frees its
   blocks and goes back to the head of the queue);
2. then, if nothing was preempted, waiting requests in FCFS order while there is room:
   ``max_num_seqs`` running, ``max_num_batched_tokens`` budget left, and enough free KV
   blocks for the cached prefix plus the first chunk.  A request that does not fit
   blocks the queue (head-of-line, as in vLLM) — this is "KV usage 100% → Waiting";
3. the step lasts ``(decode_ms_per_token / 1000 + prefill_tokens / prefill_tokens_per_s)
   * time_scale`` seconds; then every request whose tokens are all computed samples one
   output token, full blocks are committed to the prefix cache and finished requests
   free their blocks.

So TTFT = queueing + prefill of the *uncached* tokens, and it shrinks with cache hits.

Every cache change of a step (blocks stored, evicted, the cache reset) becomes a KV event,
published as one batch at the end of the step, as vLLM's scheduler does
(:mod:`gateway.sim.kvevents`); at time_scale 0 each request is its own step.

At ``time_scale == 0`` every duration is zero, so a request is admitted, computed and
finished synchronously inside its HTTP handler (:meth:`Engine.run_instant`): identical
cache effects and metrics, no engine task, no extra event-loop hop.  That is what lets one
simulator process serve thousands of requests per second in tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

from gateway.sim.kvcache import Block, PrefixCache
from gateway.sim.kvevents import KVEventRecorder, extra_keys_for
from gateway.sim.metrics import SimMetrics
from gateway.sim.options import SimOptions
from gateway.tasks import cancel_and_wait

logger = logging.getLogger("gateway.sim.engine")

# The hit rate in the log line covers recent requests, like vLLM's PrefixCachingMetrics.
HIT_RATE_WINDOW_REQUESTS = 1000


class EngineError(RuntimeError):
    """A request could not be served (engine restarted, capacity impossible)."""


class EngineRequest:
    """One sequence in the engine.  Output tokens are known upfront (deterministic filler)."""

    __slots__ = (
        "arrival",
        "blocks",
        "cache_salt",
        "cached_tokens",
        "error",
        "finish_reason",
        "finished",
        "finished_at",
        "first_token_at",
        "keys",
        "last_token_at",
        "lora_id",
        "lora_name",
        "max_tokens",
        "num_committed",
        "num_computed",
        "num_output",
        "num_prompt",
        "output",
        "scheduled_at",
        "stop_reason",
        "stream",
        "token_ids",
        "waiter",
    )

    def __init__(
        self,
        num_prompt: int,
        output: list[int],
        keys: list[int],
        stop_reason: str,
        arrival: float,
        token_ids: list[int] | None = None,
        lora: tuple[int, str] | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.num_prompt = num_prompt
        self.output = output
        self.max_tokens = len(output)
        # keys of the full blocks of prompt + output[:-1]: the last sampled token is never computed
        self.keys = keys
        # the tokens behind ``keys`` (prompt + output[:-1]), for the KV events' token_ids
        self.token_ids = token_ids
        self.lora_id, self.lora_name = lora if lora is not None else (None, None)
        self.cache_salt = cache_salt
        self.stop_reason = stop_reason  # finish_reason once max_tokens tokens exist
        self.arrival = arrival
        self.num_output = 0
        self.num_computed = 0
        self.num_committed = 0
        self.blocks: list[Block] = []
        self.cached_tokens = -1  # set at first admission (what usage reports)
        self.scheduled_at = 0.0
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.finished_at = 0.0
        self.finished = False
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.waiter: asyncio.Event | None = None
        self.stream = False  # wake the waiter on every token (streams), or only at the end


class Engine:
    """One replica's scheduler, KV cache and the accounting behind its metrics and log line."""

    def __init__(self, options: SimOptions, metrics: SimMetrics) -> None:
        self.options = options
        self.metrics = metrics
        self.block_size = options.block_size
        self.cache = PrefixCache(options.usable_gpu_blocks, options.block_size)
        self.kv_events = KVEventRecorder(
            options.block_size, int_hashes=options.kv_events_int_hashes, layout=options.kv_events_layout
        )
        self.cache.on_evict = self._evicted
        self.time_scale = options.time_scale
        self.instant = options.time_scale == 0
        self.max_num_seqs = options.max_num_seqs
        self.max_num_batched_tokens = options.max_num_batched_tokens
        self.step_base_s = options.decode_ms_per_token / 1000.0
        self.prefill_tps = options.prefill_tokens_per_s
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # totals for the periodic log line (the Prometheus counters are not readable cheaply)
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        self.total_queries = 0
        self.total_hits = 0
        self._recent: deque[tuple[int, int]] = deque()
        self._recent_queries = 0
        self._recent_hits = 0

    # -- public API ------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def recent_hit_rate(self) -> float:
        return self._recent_hits / self._recent_queries if self._recent_queries else 0.0

    def blocks_needed(self, num_prompt: int, max_tokens: int) -> int:
        """Blocks a sequence pins at its largest (prompt + all but the last output token)."""
        return -(-(num_prompt + max_tokens - 1) // self.block_size)

    def run_instant(self, req: EngineRequest) -> None:
        """Serve a request synchronously (``time_scale == 0``): same cache effects, zero time."""
        cache = self.cache
        now = time.monotonic()
        hit = cache.lookup(req.keys, req.num_prompt)
        computed = req.num_prompt + req.max_tokens - 1
        need = -(-computed // self.block_size) - len(hit)
        if not cache.can_allocate(hit, need):
            raise EngineError("the KV cache cannot hold this request right now")
        cache.touch(hit)
        if self.kv_events.active:
            blocks = self._instant_steps(req, hit, computed)
        else:
            blocks = hit + cache.allocate(need)
            cache.commit(blocks, req.keys, len(hit), computed // self.block_size)
        cache.free(blocks)
        req.scheduled_at = now
        self._record_admission(req, req.num_prompt, len(hit) * self.block_size)
        req.num_computed = computed
        req.num_output = req.max_tokens
        req.first_token_at = req.last_token_at = now
        m = self.metrics
        m.prompt_tokens.inc(req.num_prompt)
        m.ttft.observe(now - req.arrival)
        m.generation_tokens.inc(req.max_tokens)
        itl = m.itl
        for _ in range(req.max_tokens - 1):
            itl.observe(0.0)
        self.total_prompt_tokens += req.num_prompt
        self.total_generation_tokens += req.max_tokens
        self._finish(req, req.stop_reason, now)
        self.kv_events.flush()

    def _instant_steps(self, req: EngineRequest, hit: list[Block], computed: int) -> list[Block]:
        """The cache changes of :meth:`run_instant` step by step, one KV event batch per step
        as the stepping engine (and vLLM) would publish them: prefill in chunks of
        ``max_num_batched_tokens``, then one token per step (only the steps that allocate or
        fill a block change anything).  Same blocks, same order as the all-at-once path."""
        cache = self.cache
        bs = self.block_size
        blocks = list(hit)
        committed = len(hit)

        def step(to: int) -> None:
            nonlocal committed
            need = -(-to // bs) - len(blocks)
            if need > 0:
                blocks.extend(cache.allocate(need))
            full = to // bs
            if full > committed:
                cache.commit(blocks, req.keys, committed, full)
                self._stored(req, committed, full)
                committed = full
            self.kv_events.flush()

        pos = len(hit) * bs
        prompt_end = min(req.num_prompt, computed)
        while pos < prompt_end:
            pos = min(prompt_end, pos + self.max_num_batched_tokens)
            step(pos)
        while pos < computed:
            if pos % bs == 0 and pos // bs >= len(blocks):  # this token needs a new block
                pos += 1
            else:  # to the end of the current block (or of the sequence)
                pos = min((pos // bs + 1) * bs, computed)
            step(pos)
        return blocks

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request for the stepping engine.

        ``req.waiter`` is set when it finishes, and on every new token if ``req.stream``.
        """
        if req.waiter is None:
            req.waiter = asyncio.Event()
        self.waiting.append(req)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-engine")
        self._wake.set()

    def abort(self, req: EngineRequest, error: str | None = None) -> None:
        """Drop a request (client gone, restart): free its blocks, wake its handler."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        if req.blocks:
            self.cache.free(req.blocks)
            req.blocks = []
        req.error = error
        self._finish(req, "abort", time.monotonic())

    def restart(self) -> int:
        """What a vLLM restart does to the engine: in-flight requests fail, the cache is empty,
        and the KV event sequence starts from 0 again (no ``AllBlocksCleared``: a process that
        dies says nothing; consumers see the sequence go backwards)."""
        victims = [*self.running, *self.waiting]
        for req in victims:
            self.abort(req, error="the engine restarted")
        self.cache.reset()
        self.kv_events.restart()
        self._recent.clear()
        self._recent_queries = self._recent_hits = 0
        return len(victims)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's ``POST /reset_prefix_cache``: forget every cached block (``AllBlocksCleared``,
        published with the next step's batch, as vLLM does).

        Fails (False) while requests hold blocks, unless ``reset_running_requests``: then the
        running requests are preempted first (they recompute), as vLLM does.
        """
        if self.cache.num_free != self.cache.num_blocks:
            if not reset_running_requests:
                return False
            while self.running:
                self._preempt(self.running.pop())
            self._wake.set()
        self.cache.reset()
        if self.kv_events.active:
            # queued, not published: vLLM's scheduler sends it with the batch of its next step,
            # so an idle engine announces the reset only when the next request runs
            self.kv_events.cleared()
        return True

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    # -- KV events -------------------------------------------------------------------------
    def _evicted(self, key: int) -> None:
        if self.kv_events.active:
            self.kv_events.removed(key)

    def _stored(self, req: EngineRequest, start: int, end: int) -> None:
        """``BlockStored`` for ``req``'s blocks ``start..end-1``, just committed."""
        if end <= start or req.token_ids is None:
            return
        bs = self.block_size
        keys = req.keys
        self.kv_events.stored(
            keys[start:end],
            keys[start - 1] if start else None,
            req.token_ids[start * bs : end * bs],
            req.lora_id,
            req.lora_name,
            extra_keys_for(end - start, start, req.lora_name, req.cache_salt),
        )

    # -- accounting ------------------------------------------------------------------------
    def _record_admission(self, req: EngineRequest, queried: int, hit_tokens: int) -> None:
        """Prefix-cache stats, once per request (a re-admission after preemption is not counted,
        so ``vllm:prefix_cache_hits_total`` equals the sum of the responses' ``cached_tokens``)."""
        req.cached_tokens = hit_tokens
        self.metrics.prefix_queries.inc(queried)
        if hit_tokens:
            self.metrics.prefix_hits.inc(hit_tokens)
        self.total_queries += queried
        self.total_hits += hit_tokens
        recent = self._recent
        recent.append((queried, hit_tokens))
        self._recent_queries += queried
        self._recent_hits += hit_tokens
        if len(recent) > HIT_RATE_WINDOW_REQUESTS:
            q, h = recent.popleft()
            self._recent_queries -= q
            self._recent_hits -= h

    def _finish(self, req: EngineRequest, reason: str, now: float) -> None:
        req.finished = True
        req.finish_reason = reason
        req.finished_at = now
        m = self.metrics
        m.success[reason].inc()
        if reason != "abort":
            m.e2e.observe(now - req.arrival)
            m.queue_time.observe(req.scheduled_at - req.arrival)
            m.prefill_time.observe(req.first_token_at - req.scheduled_at)
            m.decode_time.observe(now - req.first_token_at)
            m.request_prompt_tokens.observe(req.num_prompt)
            m.request_generation_tokens.observe(req.num_output)
        if req.waiter is not None:
            req.waiter.set()

    # -- the stepping loop (time_scale > 0) ------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                await self._steps()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must fail requests loudly, never leave them hanging
                logger.exception("engine step failed; failing in-flight requests")
                for req in [*self.running, *self.waiting]:
                    self.abort(req, error="internal engine error")
                self.running = []
                self.waiting.clear()

    async def _steps(self) -> None:
        deadline = time.monotonic()
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                deadline = time.monotonic()
            scheduled, prefill_tokens = self._schedule()
            if not scheduled:
                # Nothing can run until something changes (an abort frees blocks).
                self._wake.clear()
                await self._wake.wait()
                continue
            duration = (self.step_base_s + prefill_tokens / self.prefill_tps) * self.time_scale
            deadline += duration
            now = time.monotonic()
            if deadline - now < -0.05:  # far behind (a stalled loop): do not burst to catch up
                deadline = now
            await asyncio.sleep(max(deadline - now, 0.0))
            self._apply(scheduled)

    def _schedule(self) -> tuple[list[tuple[EngineRequest, int]], int]:
        cache = self.cache
        bs = self.block_size
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[EngineRequest, int]] = []
        prefill_tokens = 0
        preempted = False
        running = self.running
        now = time.monotonic()

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            remaining = req.num_prompt + req.num_output - req.num_computed
            n = min(remaining, budget)
            need = -(-(req.num_computed + n) // bs) - len(req.blocks)
            self_preempted = False
            while need > cache.num_free:
                victim = running.pop()  # the lowest-priority (latest) running request
                self._preempt(victim)
                preempted = True
                if victim is req:
                    self_preempted = True
                    break
            if self_preempted:
                break  # req was the last running request
            if need > 0:
                req.blocks.extend(cache.allocate(need))
            self._cache_scheduled(req, n)
            scheduled.append((req, n))
            budget -= n
            if remaining > 1:
                prefill_tokens += n
            i += 1

        if not preempted:
            waiting = self.waiting
            while waiting and len(running) < self.max_num_seqs and budget > 0:
                req = waiting[0]
                num_tokens = req.num_prompt + req.num_output
                hit = cache.lookup(req.keys, num_tokens)
                computed = len(hit) * bs
                n = min(num_tokens - computed, budget)
                need = -(-(computed + n) // bs) - len(hit)
                if not cache.can_allocate(hit, need):
                    break
                waiting.popleft()
                cache.touch(hit)
                req.blocks = hit + cache.allocate(need)
                req.num_computed = computed
                req.num_committed = len(hit)
                self._cache_scheduled(req, n)
                if req.cached_tokens < 0:
                    req.scheduled_at = now
                    self._record_admission(req, num_tokens, computed)
                running.append(req)
                scheduled.append((req, n))
                budget -= n
                if num_tokens - computed > 1:
                    prefill_tokens += n
        return scheduled, prefill_tokens

    def _cache_scheduled(self, req: EngineRequest, n: int) -> None:
        """``req``'s blocks that are full once this step's ``n`` tokens are in are cached now,
        at scheduling, as vLLM v1 caches them when it allocates the step's slots — not once
        computed: a request admitted later in the same pass hits them (on vLLM 0.32 CPU, a
        burst of one prompt queued behind a busy engine ran in one step, and every request
        but the first reported the prompt's full blocks as cached).  Their ``BlockStored``
        goes out with the step's batch, as vLLM's does."""
        full = (req.num_computed + n) // self.block_size
        if full > req.num_committed:
            self.cache.commit(req.blocks, req.keys, req.num_committed, full)
            if self.kv_events.active:
                self._stored(req, req.num_committed, full)
            req.num_committed = full

    def _preempt(self, req: EngineRequest) -> None:
        """vLLM's recompute preemption: drop the KV, requeue at the head, keep the output so far."""
        self.cache.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_committed = 0
        self.waiting.appendleft(req)
        self.metrics.preemptions.inc()

    def _apply(self, scheduled: list[tuple[EngineRequest, int]]) -> None:
        now = time.monotonic()
        cache = self.cache
        m = self.metrics
        generated = 0
        prompt_tokens = 0
        any_finished = False
        for req, n in scheduled:
            if req.finished or not req.blocks:  # aborted or preempted during the step
                continue
            req.num_computed += n
            if req.num_computed < req.num_prompt + req.num_output:
                continue  # a prefill chunk: no token sampled yet
            req.num_output += 1
            generated += 1
            if req.num_output == 1:
                req.first_token_at = now
                prompt_tokens += req.num_prompt
                m.ttft.observe(now - req.arrival)
            else:
                m.itl.observe(now - req.last_token_at)
            req.last_token_at = now
            if req.num_output >= req.max_tokens:
                cache.free(req.blocks)
                req.blocks = []
                self._finish(req, req.stop_reason, now)
                any_finished = True
            elif req.stream and req.waiter is not None:
                req.waiter.set()
        if generated:
            m.generation_tokens.inc(generated)
            self.total_generation_tokens += generated
        if prompt_tokens:
            m.prompt_tokens.inc(prompt_tokens)
            self.total_prompt_tokens += prompt_tokens
        if any_finished:
            self.running = [r for r in self.running if not r.finished]
        self.kv_events.flush()
