"""Warm restarts end to end: a gateway over two simulated replicas, one of which restarts.

With ``warm_restart.enabled`` the gateway notices the restart (the engine's counters went
backwards), replays the hot prefixes it had routed there with ``max_tokens: 1`` — the replica
sees one-token requests — and the first real request of a hot prefix after it finds its
prefix cached.  With the feature off the restart is still noticed, but nothing is replayed
and that first request pays the whole prefill.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from gateway.http.server import RunningGateway, serve_in_thread
from gateway.sim.launcher import ReplicaGroup
from tests.configs import gateway_config
from tests.polling import wait_for

MODEL = "demo-model"
SIM = {
    "time_scale": 0,
    "enable_admin": True,
    "num_gpu_blocks": 4096,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}
TENANTS = 6
HEAD_TOKENS = 300  # each tenant's system prompt is well past one block (16 tokens)
ONE_TOKEN = re.compile(r'^vllm:request_generation_tokens_bucket\{[^}]*le="1\.0"[^}]*\} (\S+)$', re.M)


def system_prompt(tenant: int) -> str:
    words = " ".join(f"rule{tenant}x{i}" for i in range(HEAD_TOKENS // 2))
    return f"You are assistant number {tenant}. Follow these house rules strictly: {words}."


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaGroup]:
    with ReplicaGroup(2, log_dir=tmp_path_factory.mktemp("warm-sims"), **SIM).start() as replicas:
        yield replicas


@pytest.fixture
def sims(group: ReplicaGroup) -> list[str]:
    """The two replicas with empty caches and fresh counters."""
    for url in group.urls:
        httpx.post(f"{url}/sim/restart", json={"reset_metrics": True}, timeout=10).raise_for_status()
    return group.urls


def one_token_requests(url: str) -> float:
    """How many requests the replica finished with exactly one generated token (its own histogram)."""
    match = ONE_TOKEN.search(httpx.get(f"{url}/metrics", timeout=10).text)
    return float(match.group(1)) if match else 0.0


def ask(client: OpenAI, tenant: int, question: str) -> tuple[str, int]:
    """One chat completion of ``tenant``: (replica that served it, cached prompt tokens)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": system_prompt(tenant)}, {"role": "user", "content": question}],
        max_tokens=4,
    )
    reply = raw.parse()
    details = reply.usage.prompt_tokens_details if reply.usage else None
    return raw.headers["x-prefix-gateway-replica"], (details.cached_tokens or 0) if details else 0


def warm_traffic(gw: RunningGateway) -> tuple[OpenAI, str, list[int]]:
    """Three requests per tenant; returns the client, the replica with most tenants and its tenants."""
    client = OpenAI(base_url=gw.openai_base_url, api_key="unused", max_retries=0, timeout=30)
    home: dict[int, str] = {}
    for round_ in range(3):
        for tenant in range(TENANTS):
            replica, cached = ask(client, tenant, f"question {round_} of tenant {tenant}?")
            assert home.setdefault(tenant, replica) == replica  # affinity keeps a tenant on its replica
            if round_:
                assert cached > 0
    victim = max(set(home.values()), key=list(home.values()).count)
    return client, victim, [t for t, r in home.items() if r == victim]


def restart_and_detect(gw: RunningGateway, url: str, name: str) -> None:
    """Restart the replica's engine (cache flushed, counters from zero) and wait until the gateway notices."""
    replica = gw.gateway.replicas[name]
    served = httpx.get(f"{url}/sim/state", timeout=10).json()["prefix_cache_queries"]
    # a restart is seen as counters going backwards: the gateway must have seen them high first
    wait_for(
        lambda: replica.engine and replica.engine.prefix_cache_queries == served, timeout=10, what="a fresh scrape"
    )
    before = replica.restarts_detected["counters_reset"]
    httpx.post(f"{url}/sim/restart", json={"reset_metrics": True}, timeout=10).raise_for_status()
    wait_for(lambda: replica.restarts_detected["counters_reset"] > before, timeout=10, what=f"{name} restart seen")


def config(enabled: bool) -> dict[str, object]:
    return {
        "routes": [{"name": "main", "policy": "prefix"}],
        "warm_restart": {"enabled": enabled, "rate_per_s": 100, "concurrency": 2},
    }


@pytest.mark.slow
def test_restarted_replica_is_warmed_with_its_hot_prefixes(sims: list[str]) -> None:
    with serve_in_thread(gateway_config(sims, **config(True))) as gw:
        client, victim, hot = warm_traffic(gw)
        url = sims[int(victim[1:])]
        warmer = gw.gateway.warmer
        assert len(warmer.sets[("main", victim)]) == len(hot)  # one remembered prefix per tenant there

        restart_and_detect(gw, url, victim)
        wait_for(
            lambda: (s := warmer.stats.get(victim)) and s.replays["ok"] >= len(hot) and not warmer.running(),
            timeout=10,
            what="the warm-up replays",
        )
        stats = warmer.stats[victim]
        assert stats.runs == 1 and stats.replays == {"ok": len(hot), "failed": 0}
        assert one_token_requests(url) == len(hot)  # the replica saw exactly the max_tokens 1 replays
        # cold when replayed (only the chat template's first block is shared by the tenants)
        assert stats.prompt_tokens > len(hot) * HEAD_TOKENS / 2 and stats.cached_tokens < stats.prompt_tokens / 10

        replica, cached = ask(client, hot[0], "the first question after the restart?")
        assert replica == victim
        assert cached >= HEAD_TOKENS / 2  # its system prompt was already back in the cache

        # warm-ups are not user traffic: the gateway counted only the real requests
        counted = gw.gateway.stats.by_route["main"].requests
        assert counted == 3 * TENANTS + 1
        metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
        assert f'prefix_gateway_warmup_requests_total{{outcome="ok",replica="{victim}"}} {len(hot)}.0' in metrics
        assert f'prefix_gateway_replica_restarts_detected_total{{cause="counters_reset",replica="{victim}"}}' in metrics


@pytest.mark.slow
def test_nothing_is_replayed_when_off(sims: list[str]) -> None:
    with serve_in_thread(gateway_config(sims, **config(False))) as gw:
        client, victim, hot = warm_traffic(gw)
        url = sims[int(victim[1:])]
        warmer = gw.gateway.warmer
        assert warmer.sets == {}  # off: no prompt text is kept at all

        restart_and_detect(gw, url, victim)  # detection works either way
        replica, cached = ask(client, hot[0], "the first question after the restart?")
        assert replica == victim and cached == 0  # the first user pays the whole prefill
        assert warmer.stats == {} and warmer.running() == []
        assert one_token_requests(url) == 0
