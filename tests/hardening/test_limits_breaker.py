"""Per-key limits over a Redis that does not answer: the circuit breaker and lost slots.

The blackhole (``tests/blackhole.py``) accepts connections and never answers, which is what
a frozen or unreachable-but-routed Redis looks like; a refused port (the older test) fails
at once and never showed the cost of waiting.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
import redis

from gateway.http.server import serve_in_thread
from gateway.limits.admission import KeyLimiter
from gateway.state.breaker import Breaker, BreakerOpen
from tests.blackhole import switchable_redis
from tests.configs import gateway_config
from tests.hardening.hostile_upstream import MODEL
from tests.polling import until


def _post(base_url: str) -> httpx.Response:
    return httpx.post(
        f"{base_url}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        timeout=30,
    )


def test_a_blackholed_redis_is_tried_once_then_skipped(upstream: tuple[str, list[dict[str, Any]]]) -> None:
    """Before the breaker every request tried Redis twice (bucket, slot) and waited 1 s each;
    now the first call's timeout opens the breaker and later checks never reach Redis."""
    with switchable_redis(None) as hole:
        state = {"backend": "redis", "redis_url": hole.url, "share_load": False, "channel": f"t-{uuid.uuid4().hex}"}
        limits = {
            "per_key_requests_per_s": 1000,
            "per_key_concurrency": 8,
            "redis_backoff_ms": 60_000,  # no probe during the test: the count below is exact
        }
        with serve_in_thread(gateway_config([upstream[0]], state=state, limits=limits)) as gw:
            statuses = [_post(gw.openai_base_url).status_code for _ in range(5)]
            snapshot = gw.gateway.stats_snapshot()["limits"]
            metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
    assert statuses == [200] * 5
    breaker = snapshot["redis_breaker"]
    assert breaker["state"] == "open" and breaker["trips"] == 1
    # at most one check waited (50 ms; or none, when the start's warm-up PING timed out first):
    # the other checks (2 per request) were skipped
    assert breaker["failures"] <= 2 and breaker["skipped"] >= 9
    assert snapshot["redis_fallbacks"] == 10
    assert "prefix_gateway_limits_redis_breaker_open 1.0" in metrics
    assert "prefix_gateway_limits_redis_fallbacks_total 10.0" in metrics


def test_the_breaker_probes_with_a_growing_capped_backoff_and_closes() -> None:
    answers = [False, False, False, True]
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def probe() -> None:
        if not answers.pop(0):
            raise ConnectionError("no answer")

    async def fast_sleep(delay: float) -> None:
        waits.append(delay)
        await real_sleep(0)

    async def scenario() -> tuple[bool, list[str], dict[str, Any]]:
        closed: list[str] = []
        breaker = Breaker("t", probe, timeout_s=0.05, backoff_s=0.5, backoff_max_s=1.5, sleep=fast_sleep)
        breaker.on_close.append(lambda: closed.append("hook"))

        async def fails() -> None:
            raise ConnectionError("down")

        with pytest.raises(ConnectionError):
            await breaker.call(fails)
        with pytest.raises(BreakerOpen):
            await breaker.call(fails)  # not tried: open
        await until(lambda: not breaker.is_open, what="the breaker closed by a probe")
        ok = await breaker.call(lambda: real_sleep(0, result=True))
        await breaker.stop()
        return ok, closed, breaker.snapshot()

    ok, closed, snap = asyncio.run(scenario())
    assert waits == [0.5, 1.0, 1.5, 1.5]  # doubling, capped
    assert ok is True and closed == ["hook"]
    assert snap["state"] == "closed" and snap["probes"] == 4 and snap["skipped"] == 1 and snap["closes"] == 1


def test_a_slot_whose_reply_was_lost_is_freed_when_redis_answers(redis_url: str) -> None:
    """The acquire script ran but its reply never came back: the slot used to stay taken for
    ``concurrency_lease_s`` (15 min); now it is removed as soon as Redis answers again."""
    prefix = f"t-{uuid.uuid4().hex}:limits:"
    direct = redis.Redis.from_url(redis_url)

    async def scenario(proxy_url: str, set_mode: Any) -> tuple[int, int, bool, dict[str, Any]]:
        limiter = KeyLimiter(1, 0, 0, redis_url=proxy_url, prefix=prefix, redis_timeout_s=0.5, backoff_s=0.05)
        await limiter.start()
        try:
            warm = await limiter.admit("warm")  # a live connection, the script loaded
            assert warm is not None and warm.shared
            limiter.release(warm)
            await until(lambda: direct.zcard(f"{prefix}conc:warm") == 0, what="the warm-up slot released")
            held = await limiter.admit("held")  # a request running when Redis goes dark
            assert held is not None and held.shared
            set_mode("swallow")
            lost = await limiter.admit("k")  # the script runs in Redis; its reply is dropped
            assert lost is not None and not lost.shared  # answered locally meanwhile
            leaked = int(direct.zcard(f"{prefix}conc:k"))
            limiter.release(lost)
            limiter.release(held)  # the breaker is open: this release is not sent either
            await until(lambda: limiter.snapshot()["lost_slots"]["pending"] == 2, what="both slots remembered")
            set_mode("forward")
            slots = [f"{prefix}conc:k", f"{prefix}conc:held"]
            await until(lambda: sum(direct.zcard(s) for s in slots) == 0, timeout=15, what="both lost slots freed")
            again = await limiter.admit("k")  # the key's only slot is free in Redis again
            freed = limiter.orphans_freed
            assert again is not None
            limiter.release(again)
            return leaked, freed, again.shared, dict(limiter.snapshot())
        finally:
            await limiter.stop()

    with switchable_redis(redis_url, mode="forward") as proxy:

        def set_mode(mode: Any) -> None:
            proxy.mode = mode

        leaked, freed, shared_again, snap = asyncio.run(scenario(proxy.url, set_mode))
    direct.close()
    assert leaked == 1  # the lost reply really held the slot in Redis
    assert freed == 2 and shared_again
    assert snap["lost_slots"]["pending"] == 0 and snap["redis_breaker"]["closes"] >= 1


def test_an_unreachable_redis_at_start_opens_the_breaker_before_any_request() -> None:
    """The start's background warm-up PING finds the blackhole: the first request skips Redis."""

    async def scenario(url: str) -> tuple[dict[str, Any], bool]:
        limiter = KeyLimiter(0, 1000, 1000, redis_url=url)
        await limiter.start()  # returns at once: the warm-up runs in the background
        try:
            assert limiter.breaker is not None
            await until(lambda: limiter.breaker.is_open, what="the warm-up's timeout opening the breaker")
            admitted = await limiter.admit("k") is None  # no concurrency limit: no ticket, no 429
            return dict(limiter.breaker.snapshot()), admitted
        finally:
            await limiter.stop()

    with switchable_redis(None) as hole:
        snap, admitted = asyncio.run(scenario(hole.url))
    assert admitted and snap["skipped"] == 1 and snap["failures"] == 1
