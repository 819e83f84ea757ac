"""Metrics, the summary line, /admin/stats and the access log show what the responses carried."""

from __future__ import annotations

import collections
import logging
import uuid

import httpx
import pytest
from gw_helpers import MODEL, client, metric_sum, running_gateway, wait_for

from gateway.config import sha256_hex

SECRET_WORD = "zebra-7f3c"  # appears only in prompts: must never reach a log line


def drive(gw, n_prompts: int = 4, repeats: int = 3) -> tuple[dict[str, collections.Counter], int]:
    """Send repeated prompts (so caches hit), streaming every other one.

    Returns what the responses carried per replica, and how many were streamed.
    """
    c = client(gw)
    per_replica: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    streamed = 0
    tag = uuid.uuid4().hex
    recorded_before = sum(t.requests for t in gw.gateway.stats.by_route.values())
    for p in range(n_prompts):
        system = f"You are assistant {tag}-{p}. " + "Follow the rules carefully. " * 30
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {SECRET_WORD}"}]
        for r in range(repeats):
            if r % 2:
                raw = c.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=4, stream=True, stream_options={"include_usage": True}
                )
                usage = list(raw.parse())[-1].usage
                streamed += 1
            else:
                raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4)
                usage = raw.parse().usage
            totals = per_replica[raw.headers["x-prefix-gateway-replica"]]
            totals["requests"] += 1
            totals["prompt"] += usage.prompt_tokens
            totals["completion"] += usage.completion_tokens
            totals["cached"] += usage.prompt_tokens_details.cached_tokens
    # the gateway records a request just after its last byte: wait until it has recorded all of them
    wait_for(
        lambda: sum(t.requests for t in gw.gateway.stats.by_route.values()) >= recorded_before + n_prompts * repeats,
        what="every request recorded",
    )
    return per_replica, streamed


@pytest.mark.slow
def test_metrics_and_stats_equal_the_responses(sim_urls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", "admin-secret")
    with running_gateway(sim_urls[:2], routes=[{"name": "main", "policy": "session"}]) as gw:
        per_replica, streamed = drive(gw)
        text = httpx.get(f"{gw.url}/metrics").text
        total = collections.Counter()
        for replica, sums in per_replica.items():
            total.update(sums)
            labels = {"route": "main", "replica": replica}
            assert metric_sum(text, "prefix_gateway_prompt_tokens_total", **labels) == sums["prompt"]
            assert metric_sum(text, "prefix_gateway_cached_tokens_total", **labels) == sums["cached"]
            assert metric_sum(text, "prefix_gateway_completion_tokens_total", **labels) == sums["completion"]
            assert metric_sum(text, "prefix_gateway_requests_total", status_class="2xx", **labels) == sums["requests"]
        assert total["cached"] > 0  # the repeats hit the cache
        assert metric_sum(text, "prefix_gateway_cache_reported_prompt_tokens_total", route="main") == total["prompt"]
        assert metric_sum(text, "prefix_gateway_decisions_total", route="main", policy="session") == total["requests"]
        assert metric_sum(text, "prefix_gateway_ttft_seconds_count", route="main") == streamed
        assert metric_sum(text, "prefix_gateway_added_latency_seconds_count", route="main") == total["requests"]
        assert metric_sum(text, "prefix_gateway_replica_in_flight") == 0
        assert metric_sum(text, "prefix_gateway_replica_healthy") == 2

        stats = httpx.get(f"{gw.url}/admin/stats", headers={"Authorization": "Bearer admin-secret"}).json()
        route = stats["routes"]["main"]
        assert route["requests"] == total["requests"]
        assert route["prompt_tokens"] == total["prompt"] and route["cached_tokens"] == total["cached"]
        assert route["hit_rate_reported"] == pytest.approx(total["cached"] / total["prompt"], abs=1e-4)
        for replica, sums in per_replica.items():
            assert route["replicas"][replica]["cached_tokens"] == sums["cached"]
        assert set(stats["replicas"]) == {"r0", "r1"} and stats["replicas"]["r0"]["healthy"] is True

        # engine numbers are scraped and re-exported per replica
        def engine_scraped() -> bool:
            text = httpx.get(f"{gw.url}/metrics").text
            return metric_sum(text, "prefix_gateway_engine_prefix_cache_queries_total") > 0

        wait_for(engine_scraped, what="an engine scrape")
        text = httpx.get(f"{gw.url}/metrics").text
        assert 'prefix_gateway_engine_kv_cache_usage{replica="r0"}' in text
        assert 'prefix_gateway_engine_requests_running{replica="r1"}' in text


def test_summary_line_reports_the_route_hit_rate(sim_urls: list[str], caplog: pytest.LogCaptureFixture) -> None:
    with running_gateway(sim_urls[2:], routes=[{"name": "main", "policy": "session"}]) as gw:
        per_replica, _ = drive(gw, n_prompts=3, repeats=2)
        lines = gw.gateway.summary.lines()
    total = collections.Counter()
    for sums in per_replica.values():
        total.update(sums)
    assert len(lines) == 1
    text, fields = lines[0]
    assert text.startswith("Route main: Request rate: ")
    expected = total["cached"] / total["prompt"]
    assert fields["hit_rate_reported"] == pytest.approx(expected)
    assert f"Prefix cache hit rate: {expected * 100:.1f}%" in text
    assert "Healthy replicas: 2/2" in text and "TTFT p50: " in text
    assert fields["prompt_throughput"] > 0


def test_summary_loop_and_quiet_access_log(sim_urls: list[str], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with running_gateway(sim_urls[:1], logging={"summary_interval_s": 0.2}) as gw:
        drive(gw, n_prompts=1, repeats=2)
        for path in ("/health", "/ready", "/metrics"):
            httpx.get(gw.url + path)
        wait_for(lambda: any(r.name == "prefix_gateway.summary" for r in caplog.records), what="a summary line")
    access = [r.getMessage() for r in caplog.records if r.name == "prefix_gateway.access"]
    assert any('"POST /v1/chat/completions" 200' in line and "route=main replica=r0" in line for line in access)
    assert not any(p in line for line in access for p in ('"GET /health"', '"GET /ready"', '"GET /metrics"'))
    summary = [r.getMessage() for r in caplog.records if r.name == "prefix_gateway.summary"]
    assert summary[0].startswith("Route main: ")
    assert all(SECRET_WORD not in r.getMessage() for r in caplog.records)


def test_probe_access_logging_can_be_turned_on(sim_urls: list[str], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with running_gateway(sim_urls[:1], logging={"access_log_probes": True}) as gw:
        httpx.get(gw.url + "/health")
    assert any('"GET /health" 200' in r.getMessage() for r in caplog.records if r.name == "prefix_gateway.access")


def test_admin_is_off_without_a_key_and_checks_the_key(sim_urls: list[str]) -> None:
    with running_gateway(sim_urls[:1]) as gw:
        off = httpx.get(f"{gw.url}/admin/stats")
        assert off.status_code == 404 and off.json()["error"]["code"] == "admin_disabled"
    admin = {"api_key_sha256": sha256_hex("let-me-in")}
    with running_gateway(sim_urls[:1], admin=admin) as gw:
        assert httpx.get(f"{gw.url}/admin/stats").status_code == 401
        wrong = httpx.get(f"{gw.url}/admin/stats", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.get(f"{gw.url}/admin/stats", headers={"Authorization": "Bearer let-me-in"})
        assert ok.status_code == 200 and "main" in ok.json()["routes"]


def test_embedding_a_gateway_leaves_host_logging_alone(sim_urls: list[str]) -> None:
    access = logging.getLogger("uvicorn.access")
    before = (list(access.handlers), access.propagate, access.disabled)
    with running_gateway(sim_urls[:1]):
        pass
    assert (list(access.handlers), access.propagate, access.disabled) == before
