"""Warm restarts, unit by unit: the hot set's bounds and ranking, restart detection, the replay
rewrite, the warmer's pacing and stop rules, and the config's field-level errors.

The end-to-end behaviour against simulated replicas is in tests/fleet/test_fleet_warm_restart.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.config import ConfigError, GatewayConfig, HealthSettings, ReplicaConfig, parse_config
from gateway.replicas.engine import EngineStats
from gateway.replicas.hotset import HotSet
from gateway.replicas.outlier import Fleet
from gateway.replicas.pool import Replica
from gateway.replicas.warmup import WARMUP_HEADER, Warmer, prefix_identity, replay_body
from gateway.routing.base import RequestView
from tests.polling import until

# -- the hot set -------------------------------------------------------------------------------


def test_more_requests_rank_hotter_and_the_latest_body_is_kept() -> None:
    hot = HotSet(max_prefixes=10, max_bytes=1 << 20, half_life_s=60)
    for i in range(5):
        hot.touch("a", "chat", f"a{i}".encode(), now=float(i))
    hot.touch("b", "completions", b"b0", now=5.0)
    top = hot.hottest(2)
    assert [e.body for e in top] == [b"a4", b"b0"]  # the latest body of "a", hottest first
    assert top[0].requests == 5 and top[1].endpoint == "completions"
    assert hot.bytes == len(b"a4") + len(b"b0")


def test_recency_outweighs_old_popularity() -> None:
    hot = HotSet(max_prefixes=10, max_bytes=1 << 20, half_life_s=10)
    for _ in range(4):
        hot.touch("old", "chat", b"x", now=0.0)  # 4 requests, three half-lives ago
    for _ in range(2):
        hot.touch("new", "chat", b"y", now=30.0)  # 2 requests now: worth 16 of those
    assert [e.body for e in hot.hottest(2)] == [b"y", b"x"]


def test_count_bound_drops_the_coldest() -> None:
    hot = HotSet(max_prefixes=8, max_bytes=1 << 20, half_life_s=1000)
    for t in range(20):
        hot.touch("hot", "chat", b"h", now=float(t))  # one prefix asked for all the time...
        hot.touch(f"once-{t}", "chat", b"o", now=float(t))  # ...among many asked for once
        assert len(hot) <= 8
    assert hot.hottest(1)[0].body == b"h"
    assert hot.dropped > 0


def test_byte_bound_holds_and_huge_bodies_are_refused() -> None:
    hot = HotSet(max_prefixes=1000, max_bytes=4096, half_life_s=1000)
    for t in range(40):
        assert hot.touch(t, "chat", b"x" * 500, now=float(t))
        assert hot.bytes <= 4096 and hot.bytes == sum(len(e.body) for e in hot.entries.values())
    assert not hot.touch("huge", "chat", b"x" * 2000, now=50.0)  # over a quarter of the budget
    assert "huge" not in hot.entries and hot.refused == 1
    hot.touch(39, "chat", b"x" * 10, now=51.0)  # a smaller latest body gives bytes back
    assert hot.bytes == sum(len(e.body) for e in hot.entries.values())


def test_scores_stay_finite_over_a_long_run() -> None:
    hot = HotSet(max_prefixes=10, max_bytes=1 << 20, half_life_s=1.0)
    hot.touch("a", "chat", b"a", now=0.0)
    hot.touch("a", "chat", b"a", now=0.0)
    hot.touch("b", "chat", b"b", now=10_000.0)  # 10,000 half-lives later: 2^10000 would overflow
    assert [e.body for e in hot.hottest(2)] == [b"b", b"a"]
    assert all(e.score < 1e30 for e in hot.entries.values())


# -- the replay rewrite and the prefix identity ------------------------------------------------------


def test_replay_body_asks_for_one_token_and_keeps_the_prompt() -> None:
    original = {
        "model": "m",
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "cache_salt": "tenant-1",
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 3,
        "max_completion_tokens": 200,
        "min_tokens": 5,
        "logprobs": True,
    }
    out = json.loads(replay_body(json.dumps(original).encode()) or b"")
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1 and out["stream"] is False and out["n"] == 1
    assert "stream_options" not in out and "min_tokens" not in out and "logprobs" not in out
    for kept in ("model", "messages", "tools", "cache_salt"):
        assert out[kept] == original[kept]
    assert replay_body(b"not json") is None and replay_body(b"[1, 2]") is None


def view(keys: tuple[int, ...], session: str | None = None, token_blocks: int | None = None) -> RequestView:
    return RequestView("id", "main", "m", "chat", session, keys, 16, token_blocks=token_blocks)


def test_prefix_identity() -> None:
    keys = tuple(range(100, 140))  # 40 blocks of 16 tokens
    assert prefix_identity(view(keys), key_tokens=256) == keys[15]  # the key of the first 256 tokens
    assert prefix_identity(view(keys[:3]), key_tokens=256) == keys[2]  # shorter: its deepest block
    assert prefix_identity(view(keys, token_blocks=5), key_tokens=256) == keys[4]  # never a text-chunk key
    assert prefix_identity(view(keys, session="conv-7"), key_tokens=256) == ("session", "conv-7")
    assert prefix_identity(view(()), key_tokens=256) is None  # shorter than one block


# -- detection -----------------------------------------------------------------------------------------


class NullClient:
    base_url = "http://unused"


def watched(n: int = 1) -> tuple[list[Replica], list[tuple[str, str]]]:
    """Replicas in a fleet whose cold signals are recorded as (replica, cause)."""
    settings = HealthSettings(unhealthy_threshold=1, healthy_threshold=1)
    members: list[Replica] = []
    group = Fleet(lambda: members, settings)
    seen: list[tuple[str, str]] = []
    group.on_cold = lambda replica, cause: seen.append((replica.name, cause))
    members.extend(
        Replica(ReplicaConfig(name=f"r{i}", url=f"http://h:{i + 1}"), NullClient(), settings, fleet=group)  # type: ignore[arg-type]
        for i in range(n)
    )
    return members, seen


def stats(queries: float | None, prompt: float | None = None, generated: float | None = None) -> EngineStats:
    return EngineStats(0.0, prefix_cache_queries=queries, prompt_tokens=prompt, generation_tokens=generated)


def test_counters_going_backwards_is_a_restart() -> None:
    (r,), seen = watched()
    r.set_engine(stats(100, 100, 10))  # the first scrape: nothing to compare with
    r.set_engine(stats(150, 150, 12))
    r.set_engine(stats(None, None, None))  # series missing: unknown, not a reset
    assert seen == [] and r.restarts_detected["counters_reset"] == 0
    r.set_engine(stats(150, 150, 12))
    r.set_engine(stats(150, 150, 3))  # one counter back is enough
    assert seen == [("r0", "counters_reset")] and r.restarts_detected["counters_reset"] == 1
    r.set_engine(stats(160, 160, 5))  # it keeps counting from there: no new signal
    assert len(seen) == 1


def test_returning_to_healthy_is_a_rejoin() -> None:
    (r,), seen = watched()
    r.record_probe(True, now=1.0)  # healthy already: nothing
    r.record_probe(False, "refused", now=2.0)
    assert not r.healthy and seen == []
    r.record_probe(True, now=3.0)
    assert r.healthy and seen == [("r0", "rejoined")] and r.restarts_detected == {"counters_reset": 0, "rejoined": 1}


# -- the warmer ----------------------------------------------------------------------------------------


@dataclass
class FakeResponse:
    status: int
    data: bytes
    content_type: str | None = "application/json"

    async def read(self) -> bytes:
        return self.data

    def release(self) -> None:
        pass

    def abort(self) -> None:
        pass


class RecordingClient:
    """Answers every POST after ``delay_s`` with ``status``; records what it was sent."""

    base_url = "http://fake"

    def __init__(self, status: int = 200, delay_s: float = 0.0) -> None:
        self.status = status
        self.delay_s = delay_s
        self.posts: list[tuple[str, dict[str, Any], dict[str, str], float]] = []
        self.active = 0
        self.peak = 0

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> FakeResponse:
        self.posts.append((path, json.loads(body), dict(headers), time.monotonic()))
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.active -= 1
        usage = {"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 16}}}
        return FakeResponse(self.status, json.dumps(usage).encode())


@dataclass
class FakeRunner:
    replicas: list[Replica]


@dataclass
class FakeRoute:
    name: str
    config: Any
    runner: FakeRunner


class Setup:
    """A warmer over one route and one replica (with a recording client)."""

    def __init__(self, client: RecordingClient | None = None, **warm: Any) -> None:
        self.client = client or RecordingClient()
        self.config: GatewayConfig = parse_config(
            {
                "replicas": [{"name": "r0", "url": "http://h:1", "api_key": "replica-key"}],
                "routes": [{"name": "main", "policy": "prefix"}],
                "warm_restart": {"enabled": True, "rate_per_s": 1000, **warm},
            }
        )
        replicas, _ = watched()
        self.replica = replicas[0]
        self.replica.client = self.client  # type: ignore[assignment]
        self.replica.auth_header = "Bearer replica-key"
        self.route = FakeRoute("main", self.config.routes[0], FakeRunner([self.replica]))
        self.warmer = Warmer(lambda: self.config, lambda: [self.route], lambda: {"r0": self.replica})  # type: ignore[list-item, return-value]
        self.replica.fleet.on_cold = self.warmer.on_cold  # type: ignore[union-attr]

    def remember(self, prefix: int, times: int = 1, now: float = 0.0) -> None:
        body = json.dumps({"model": "m", "prompt": f"prefix {prefix}", "stream": True, "max_tokens": 50}).encode()
        for _ in range(times):
            request = RequestView("id", "main", "m", "completions", None, (prefix,), 16)
            self.warmer.remember(self.route, "r0", request, body, now=now)  # type: ignore[arg-type]

    def replayed(self) -> list[str]:
        return [body["prompt"] for _, body, _, _ in self.client.posts]


async def test_replays_hottest_first_with_one_token_and_the_replicas_key() -> None:
    s = Setup(max_replays=3)
    for prefix, times in ((1, 1), (2, 5), (3, 3), (4, 2)):
        s.remember(prefix, times)
    s.replica.record_probe(False, "down")
    s.replica.record_probe(True)  # back: "rejoined"
    await until(lambda: not s.warmer.running() and s.warmer.stats["r0"].runs == 1, what="the warm-up")
    assert s.replayed() == ["prefix 2", "prefix 3", "prefix 4"]  # the 3 hottest, hottest first
    path, body, headers, _ = s.client.posts[0]
    assert path == "/v1/completions" and body["max_tokens"] == 1 and body["stream"] is False
    assert headers["Authorization"] == "Bearer replica-key" and headers[WARMUP_HEADER] == "1"
    stats = s.warmer.stats["r0"]
    assert stats.replays == {"ok": 3, "failed": 0} and stats.prompt_tokens == 300 and stats.cached_tokens == 48
    assert s.replica.in_flight == 0


async def test_second_signal_of_one_restart_is_skipped_by_the_cooldown() -> None:
    s = Setup(cooldown_s=60)
    s.remember(1)
    s.replica.set_engine(stats(100))
    s.replica.set_engine(stats(0))  # counters reset: warm-up
    await until(lambda: not s.warmer.running() and len(s.client.posts) == 1, what="the warm-up")
    s.replica.record_probe(False, "down")
    s.replica.record_probe(True)  # the same restart seen again
    assert s.warmer.stats["r0"].runs == 1 and s.warmer.stats["r0"].skipped["cooldown"] == 1
    assert len(s.client.posts) == 1


async def test_rejoin_can_be_ignored_and_a_restart_while_down_waits_for_the_return() -> None:
    s = Setup(on_rejoin=False, cooldown_s=0)
    s.remember(1)
    s.replica.record_probe(False, "down")
    s.replica.record_probe(True)
    assert s.warmer.running() == [] and "r0" not in s.warmer.stats  # on_rejoin off: a return alone is not enough
    s.replica.set_engine(stats(100))
    s.replica.record_probe(False, "down")
    s.replica.set_engine(stats(0))  # the counters reset while it is still marked down...
    assert s.warmer.running() == []
    s.replica.record_probe(True)  # ...so the warm-up starts when it is back
    await until(lambda: len(s.client.posts) == 1 and not s.warmer.running(), what="the deferred warm-up")


async def test_rate_and_concurrency_are_bounded() -> None:
    s = Setup(RecordingClient(delay_s=0.05), rate_per_s=40, concurrency=2)
    for prefix in range(8):
        s.remember(prefix)
    s.replica.set_engine(stats(100))
    s.replica.set_engine(stats(0))
    await until(lambda: not s.warmer.running() and len(s.client.posts) == 8, timeout=10, what="8 replays")
    starts = [t for *_, t in s.client.posts]
    assert starts[-1] - starts[0] >= 7 / 40 * 0.9  # at most 40 starts per second
    assert s.client.peak <= 2


async def test_failing_replays_stop_the_warm_up_until_the_replica_is_back() -> None:
    s = Setup(RecordingClient(status=503), concurrency=1)
    for prefix in range(10):
        s.remember(prefix)
    s.replica.set_engine(stats(100))
    s.replica.set_engine(stats(0))
    await until(lambda: s.warmer.stats["r0"].last_duration_s is not None, what="the warm-up to end")
    assert len(s.client.posts) == 3 and s.warmer.stats["r0"].replays == {"ok": 0, "failed": 3}
    # a warm-up that stopped early does not count for the cooldown: the return starts a new one
    s.client.status = 200
    s.replica.record_probe(False, "down")
    s.replica.record_probe(True)
    await until(lambda: s.warmer.stats["r0"].replays["ok"] == 10 and not s.warmer.running(), what="the retry")
    assert s.warmer.stats["r0"].runs == 2


async def test_off_keeps_nothing_and_replays_nothing() -> None:
    s = Setup()
    s.config = s.config.model_copy(update={"warm_restart": s.config.warm_restart.model_copy(update={"enabled": False})})
    s.remember(1, times=3)
    assert s.warmer.sets == {}
    s.replica.set_engine(stats(100))
    s.replica.set_engine(stats(0))
    assert s.replica.restarts_detected["counters_reset"] == 1  # noticed all the same
    assert s.warmer.running() == [] and s.warmer.stats == {}


# -- config ----------------------------------------------------------------------------------------------

BASE = {"replicas": [{"name": "a", "url": "http://127.0.0.1:1"}]}


def test_off_by_default_and_a_route_may_override() -> None:
    config = parse_config({**BASE, "routes": [{"name": "x"}, {"name": "y", "warm_restart": {"enabled": True}}]})
    assert not config.warm_restart.enabled
    assert not config.warm_restart_of(config.routes[0]).enabled
    assert config.warm_restart_of(config.routes[1]).enabled


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"warm_restart": {"max_prefixes": 0}}, "warm_restart.max_prefixes"),
        ({"warm_restart": {"max_bytes": 10}}, "warm_restart.max_bytes"),
        ({"warm_restart": {"rate_per_s": 0}}, "warm_restart.rate_per_s"),
        ({"warm_restart": {"enabeld": True}}, "warm_restart.enabeld"),
        ({"routes": [{"name": "x", "warm_restart": {"concurrency": 0}}]}, "routes[0].warm_restart.concurrency"),
    ],
)
def test_bad_settings_name_the_field(data: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({**BASE, **data}, "gw.yaml")
    assert f"gw.yaml: {where}: " in str(caught.value)
