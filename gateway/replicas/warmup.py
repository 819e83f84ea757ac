"""Warm restarts: replay a restarted replica's hottest prefixes so its first users hit a warm cache.

A vLLM replica that restarts (or rejoins after a failure) has an empty prefix cache, yet the
prefix policy keeps sending it the prompts it used to hold: the first users of every hot
prefix pay its full prefill.  With ``warm_restart.enabled`` the gateway:

1. **remembers**, per route and replica, the hottest prefixes it routed there and the latest
   body of each (:class:`~gateway.replicas.hotset.HotSet`, bounded in count and bytes) —
   after each completed request, from the bytes it already sent upstream;
2. **notices** a restart: the replica's engine counters went backwards between scrapes, or
   it returned to healthy after being down or ejected (``Replica._cold`` → ``Fleet.note_cold``);
3. **replays** the hottest ``max_replays`` prefixes to that replica, hottest first, each body
   rewritten to ``max_tokens: 1`` and ``stream: false``, straight to the replica (not through
   routing), with the replica's own API key, at most ``rate_per_s`` starts per second and
   ``concurrency`` in flight, *while* it serves new traffic.

Why concurrently and not before: holding a healthy replica out of its pools would send its
keys to replicas that are just as cold for them (and pile its load on them), and a restart
seen only through the counters is noticed after the replica is already serving.  Hottest
first means the prefixes most likely to be asked for next are warm within the first
replays; a prefix that real traffic re-warmed first costs its replay one block of prefill.

Replays never count as user traffic: they bypass the request path, so they appear in no
request, token or hit-rate metric of the gateway (the engine's own counters do include them;
``prefix_gateway_warmup_prompt_tokens_total`` says how much).  They do count in the
replica's in-flight load while they run, so routing sees the work.  A warm-up stops early
when the replica goes down or leaves, or after three failed replays in a row; a replica
warmed less than ``cooldown_s`` ago is not warmed again (a restart usually shows both
signals: down then up, and counters reset).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.config import GatewayConfig, WarmRestartSettings
from gateway.replicas.hotset import HotPrefix, HotSet
from gateway.replicas.pool import COLD_CAUSES, Replica
from gateway.tasks import cancel_and_wait
from gateway.upstream.errors import UpstreamError

if TYPE_CHECKING:
    from gateway.routing.base import RequestView
    from gateway.routing.routes import Route

log = logging.getLogger("prefix_gateway.warmup")

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
#: a warm-up stops after this many failed replays in a row (the replica is not ready after all)
MAX_CONSECUTIVE_FAILURES = 3
#: request header that marks a replay upstream (replica logs, proxies in between)
WARMUP_HEADER = "X-Prefix-Gateway-Warmup"
#: sampling fields that would make a one-token replay fail or cost more than one token
_DROP = ("stream_options", "best_of", "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "echo")


def replay_body(body: bytes) -> bytes | None:
    """The request ``body`` rewritten for a replay: one output token, no stream, one choice.

    Everything that shapes the prompt (messages, tools, cache_salt, LoRA model name, chat
    template arguments) is kept, so the replica computes exactly the blocks the original did.
    None if the body is not a JSON object.
    """
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    for name in _DROP:
        data.pop(name, None)
    data["max_tokens"] = 1
    if "max_completion_tokens" in data:
        data["max_completion_tokens"] = 1
    data["stream"] = False
    if "n" in data:
        data["n"] = 1
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()


def _usage(data: bytes) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) of a non-streaming answer; 0 for what it does not say."""
    try:
        usage = json.loads(data).get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0, 0


def prefix_identity(request: RequestView, key_tokens: int) -> Hashable | None:
    """What makes two requests "the same prefix": the session, else the key of the first ``key_tokens``."""
    if request.session_key:
        return ("session", request.session_key)
    keys = request.block_keys
    blocks = request.token_blocks if request.token_blocks is not None else len(keys)
    if not keys or blocks <= 0 or request.block_size <= 0:
        return None  # shorter than one block: nothing worth warming
    depth = min(blocks, max(1, key_tokens // request.block_size))
    return keys[depth - 1]


@dataclass
class ReplicaWarmups:
    """What warm-ups did for one replica (``/admin/stats``, metrics)."""

    runs: int = 0
    replays: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})
    skipped: dict[str, int] = field(default_factory=lambda: {"cooldown": 0, "running": 0})
    prompt_tokens: int = 0
    cached_tokens: int = 0
    last_cause: str | None = None
    last_started: float | None = None  # time.monotonic()
    last_duration_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "replays": dict(self.replays),
            "skipped": dict(self.skipped),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "last_cause": self.last_cause,
            "last_duration_s": None if self.last_duration_s is None else round(self.last_duration_s, 3),
        }


class Warmer:
    """Remembers hot prefixes per (route, replica) and replays them when a replica comes back cold."""

    def __init__(
        self,
        config: Callable[[], GatewayConfig],
        routes: Callable[[], Sequence[Route]],
        replicas: Callable[[], dict[str, Replica]],
    ) -> None:
        self._config = config
        self._routes = routes
        self._replicas = replicas
        self.sets: dict[tuple[str, str], HotSet] = {}
        self.stats: dict[str, ReplicaWarmups] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._pending: set[str] = set()  # restarted while down: warm at its return

    # -- remembering (request path) ----------------------------------------------------
    def settings_for(self, route: Route) -> WarmRestartSettings:
        return self._config().warm_restart_of(route.config)

    def remember(self, route: Route, replica: str, request: RequestView, body: bytes, now: float | None = None) -> None:
        """A request completed on ``replica``: count its prefix (and keep its body to replay)."""
        settings = self.settings_for(route)
        if not settings.enabled or request.endpoint not in PATHS:
            return
        key = prefix_identity(request, settings.key_tokens)
        if key is None:
            return
        hot = self.sets.get((route.name, replica))
        if hot is None:
            self._forget_departed()
            hot = self.sets[(route.name, replica)] = HotSet(
                settings.max_prefixes, settings.max_bytes, settings.half_life_s
            )
        elif (hot.max_prefixes, hot.max_bytes, hot.half_life_s) != (
            settings.max_prefixes,
            settings.max_bytes,
            settings.half_life_s,
        ):
            hot.resize(settings.max_prefixes, settings.max_bytes, settings.half_life_s)  # a reload changed them
        hot.touch(key, request.endpoint, body, time.monotonic() if now is None else now)

    def _forget_departed(self) -> None:
        """Drop the hot sets of routes and replicas that no longer exist (membership churn)."""
        routes = {r.name for r in self._routes()}
        replicas = self._replicas()
        for key in [k for k in self.sets if k[0] not in routes or k[1] not in replicas]:
            del self.sets[key]

    # -- noticing ----------------------------------------------------------------------
    def on_cold(self, replica: Replica, cause: str) -> None:
        """``Fleet.on_cold``: ``replica`` restarted (``counters_reset``) or came back (``rejoined``)."""
        pending = replica.name in self._pending
        jobs = [j for j in self._jobs(replica) if cause != "rejoined" or pending or j[1].on_rejoin]
        if not jobs:
            return  # off for every route of this replica, or nothing remembered
        stats = self.stats.setdefault(replica.name, ReplicaWarmups())
        if not replica.healthy:
            self._pending.add(replica.name)  # its return ("rejoined") starts the warm-up
            return
        if replica.name in self._tasks:
            stats.skipped["running"] += 1
            return
        cooldown = max(settings.cooldown_s for _, settings, _ in jobs)
        now = time.monotonic()
        if stats.last_started is not None and now - stats.last_started < cooldown:
            stats.skipped["cooldown"] += 1
            return
        self._pending.discard(replica.name)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the event loop (unit tests poking a Replica): nothing to run
            return
        stats.runs += 1
        stats.last_cause, stats.last_started = cause, now
        count = sum(len(entries) for _, _, entries in jobs)
        log.info("replica %s %s: replaying its %d hottest prefix(es)", replica.name, _CAUSE_TEXT[cause], count)
        task = loop.create_task(self._run(replica, jobs, stats), name=f"warmup-{replica.name}")
        self._tasks[replica.name] = task
        task.add_done_callback(lambda _t, name=replica.name: self._tasks.pop(name, None))

    def _jobs(self, replica: Replica) -> list[tuple[str, WarmRestartSettings, list[HotPrefix]]]:
        """Per route with warm restarts on and ``replica`` in its pool: the prefixes to replay."""
        jobs = []
        for route in self._routes():
            settings = self.settings_for(route)
            if not settings.enabled or replica not in route.runner.replicas:
                continue
            hot = self.sets.get((route.name, replica.name))
            entries = hot.hottest(settings.max_replays) if hot is not None else []
            if entries:
                jobs.append((route.name, settings, entries))
        return jobs

    # -- replaying ---------------------------------------------------------------------
    async def _run(
        self, replica: Replica, jobs: list[tuple[str, WarmRestartSettings, list[HotPrefix]]], stats: ReplicaWarmups
    ) -> None:
        started = time.monotonic()
        sent = 0
        stopped = False
        try:
            for _route, settings, entries in jobs:
                count, stopped = await self._replay_all(replica, settings, entries, stats)
                sent += count
                if stopped:
                    break
        finally:
            stats.last_duration_s = time.monotonic() - started
            if stopped:
                # The replica was not ready after all (down, failing, gone): this run does not
                # count for the cooldown, and its return to healthy starts a fresh one.
                stats.last_started = None
                self._pending.add(replica.name)
            log.info(
                "replica %s warm-up done: %d replayed in %.2f s (%d ok, %d failed so far)%s",
                replica.name,
                sent,
                stats.last_duration_s,
                stats.replays["ok"],
                stats.replays["failed"],
                "; stopped early (replica down, gone or failing)" if stopped else "",
            )

    async def _replay_all(
        self, replica: Replica, settings: WarmRestartSettings, entries: list[HotPrefix], stats: ReplicaWarmups
    ) -> tuple[int, bool]:
        """Replay ``entries`` in order, paced and bounded; returns (replays started, stopped early)."""
        gate = asyncio.Semaphore(settings.concurrency)
        interval = 1.0 / settings.rate_per_s
        outcomes: list[bool] = []  # in completion order
        tasks: list[asyncio.Task[None]] = []

        async def one(entry: HotPrefix) -> None:
            try:
                outcomes.append(await self._replay(replica, entry, settings.timeout_s, stats))
            finally:
                gate.release()

        def failing() -> bool:
            tail = outcomes[-MAX_CONSECUTIVE_FAILURES:]
            return len(tail) == MAX_CONSECUTIVE_FAILURES and not any(tail)

        stopped = False
        next_at = time.monotonic()
        try:
            for entry in entries:
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await gate.acquire()
                if failing() or not self._still_serving(replica):
                    gate.release()
                    stopped = True
                    break
                next_at = time.monotonic() + interval
                tasks.append(asyncio.create_task(one(entry)))
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return len(tasks), stopped or failing()

    def _still_serving(self, replica: Replica) -> bool:
        return replica.healthy and self._replicas().get(replica.name) is replica

    async def _replay(self, replica: Replica, entry: HotPrefix, timeout_s: float, stats: ReplicaWarmups) -> bool:
        """One replay; True if the replica answered 200.  Never raises (but lets cancellation through)."""
        body = replay_body(entry.body)
        if body is None:
            stats.replays["failed"] += 1
            return False
        headers = {
            "Content-Type": "application/json",
            "X-Request-Id": "warmup-" + os.urandom(8).hex(),
            WARMUP_HEADER: "1",
        }
        if replica.auth_header:
            headers["Authorization"] = replica.auth_header  # the replica's own key, as for real traffic
        replica.in_flight += 1  # real work on the replica: the load bound sees it
        try:
            async with asyncio.timeout(timeout_s):
                response = await replica.client.post(PATHS[entry.endpoint], body, headers)
                try:
                    data = await response.read()
                except BaseException:
                    response.abort()
                    raise
                response.release()
        except (UpstreamError, TimeoutError) as exc:
            stats.replays["failed"] += 1
            log.debug("replica %s: a warm-up replay failed: %s", replica.name, exc)
            return False
        finally:
            replica.in_flight -= 1
        if response.status != 200:
            stats.replays["failed"] += 1
            log.debug("replica %s: a warm-up replay got HTTP %d", replica.name, response.status)
            return False
        stats.replays["ok"] += 1
        prompt, cached = _usage(data)
        stats.prompt_tokens += prompt
        stats.cached_tokens += cached
        return True

    # -- lifecycle and views -----------------------------------------------------------
    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks.values())
        self._tasks.clear()

    def running(self) -> list[str]:
        return sorted(self._tasks)

    def snapshot(self) -> dict[str, Any]:
        """``/admin/stats`` → ``warm_restart``: sizes of the hot sets (never their content) and warm-ups."""
        routes: dict[str, dict[str, Any]] = {}
        for (route, replica), hot in sorted(self.sets.items()):
            routes.setdefault(route, {})[replica] = {
                "prefixes": len(hot),
                "bytes": hot.bytes,
                "dropped": hot.dropped,
                "refused": hot.refused,
            }
        return {
            "hot_prefixes": routes,
            "warmups": {name: s.as_dict() for name, s in sorted(self.stats.items())},
            "running": self.running(),
        }


_CAUSE_TEXT = {"counters_reset": "restarted (engine counters reset)", "rejoined": "is back"}
assert set(_CAUSE_TEXT) == set(COLD_CAUSES)
