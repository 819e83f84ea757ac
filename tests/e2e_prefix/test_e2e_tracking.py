"""Hit rates per route and per replica, side by side — reported (responses' cached_tokens),
predicted (the prefix policy) and engine (scraped vllm:prefix_cache_*) — in /metrics,
/admin/stats and the summary line, equal to what the responses carried."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

import httpx
import pytest
from e2e_helpers import ADMIN_KEY, MODEL, Conversation, admin, client, gateway, metric_sum, prefix_route, wait_for
from openai import OpenAI

from gateway.sim.launcher import ReplicaGroup

ROUTES = {"agents": "relocate", "main": "report"}


# demo-model has no known family: cl100k_base is a guess, over the generic template
GUESSED = (
    "approximate (cl100k_base): tokenizer cl100k_base guessed from the model name; "
    "template chatml-like (not the model's)"
)


def stream_once(sdk: OpenAI, topic: str, sums: dict[tuple[str, str], Counter[str]]) -> None:
    messages = [*Conversation(topic).messages, {"role": "user", "content": "Stream me a short answer."}]
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage for chunk in raw.parse() if chunk.usage is not None][-1]
    key = (raw.headers["x-prefix-gateway-route"], raw.headers["x-prefix-gateway-replica"])
    sums[key].update(prompt=usage.prompt_tokens, cached=usage.prompt_tokens_details.cached_tokens)


def percent(text: str, name: str) -> str:
    match = re.search(rf"{name}: ([^,]+)", text)
    assert match, (name, text)
    return match.group(1)


def test_hit_rates_in_metrics_stats_and_summary_equal_the_responses(
    fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    routes = [
        prefix_route("agents", "relocate", match={"models": [MODEL], "header": {"name": "x-tenant", "values": ["a*"]}}),
        prefix_route("main", "report"),
    ]
    sums: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)  # (route, replica) -> prompt/cached tokens
    with gateway(fleet.urls, routes=routes) as gw:
        sdks = {"agents": client(gw, **{"x-tenant": "acme"}), "main": client(gw)}
        for route, sdk in sdks.items():
            conversations = [Conversation(f"{route} topic {t}") for t in ("tea", "maps", "kites")]
            for question in ("Hello?", "And then?", "Why?"):
                for conv in conversations:
                    reply = conv.turn(sdk, question)
                    assert reply.route == route
                    sums[(route, reply.replica)].update(prompt=reply.prompt_tokens, cached=reply.cached_tokens)
            stream_once(sdk, f"{route} streaming", sums)
        totals = {route: Counter() for route in ROUTES}
        for (route, _), s in sums.items():
            totals[route].update(s)
        fleet_prompt = sum(t["prompt"] for t in totals.values())
        fleet_cached = sum(t["cached"] for t in totals.values())

        # /metrics: the counters are the responses' sums, per route and per replica
        text = httpx.get(f"{gw.url}/metrics").text
        for (route, replica), s in sums.items():
            labels = {"route": route, "replica": replica}
            assert metric_sum(text, "prefix_gateway_prompt_tokens_total", **labels) == s["prompt"]
            assert metric_sum(text, "prefix_gateway_cached_tokens_total", **labels) == s["cached"]
            assert metric_sum(text, "prefix_gateway_cache_reported_prompt_tokens_total", **labels) == s["prompt"]
            assert metric_sum(text, "prefix_gateway_predicted_prompt_tokens_total", **labels) == s["prompt"]
        for route, t in totals.items():
            cached = metric_sum(text, "prefix_gateway_cached_tokens_total", route=route)
            prompt = metric_sum(text, "prefix_gateway_cache_reported_prompt_tokens_total", route=route)
            assert cached / prompt == pytest.approx(t["cached"] / t["prompt"])
            assert t["cached"] > 0.4 * t["prompt"]  # the conversations did hit the cache
            predicted = metric_sum(text, "prefix_gateway_predicted_cached_tokens_total", route=route)
            assert 0 < predicted <= t["cached"]  # the index stores every 4th block: a lower bound
            for i in range(4):
                assert metric_sum(text, "prefix_gateway_route_replica_info", route=route, replica=f"r{i}") == 1

        # the engines saw exactly this traffic (a fresh fleet): their scraped hit rate is the same
        def scraped_all() -> bool:
            text = httpx.get(f"{gw.url}/metrics").text
            return metric_sum(text, "prefix_gateway_engine_prefix_cache_queries_total") == fleet_prompt

        wait_for(scraped_all, what="an engine scrape that saw every request")
        text = httpx.get(f"{gw.url}/metrics").text
        assert metric_sum(text, "prefix_gateway_engine_prefix_cache_hits_total") == fleet_cached

        # /admin/stats: the same numbers, side by side, plus the policy's state
        with admin(gw) as api:
            stats = api.get("/admin/stats").json()
        lines = {fields["route"]: (line, fields) for line, fields in gw.gateway.summary.lines()}

    for route, t in totals.items():
        view = stats["routes"][route]
        assert view["hit_rate_reported"] == pytest.approx(t["cached"] / t["prompt"], abs=1e-4)
        assert view["predicted_prompt_tokens"] == t["prompt"]
        assert view["hit_rate_predicted"] == pytest.approx(view["predicted_cached_tokens"] / t["prompt"], abs=1e-4)
        assert view["engine_hit_rate"] == pytest.approx(fleet_cached / fleet_prompt, abs=1e-4)
        for (r, replica), s in sums.items():
            if r == route:
                assert view["replicas"][replica]["hit_rate_reported"] == pytest.approx(
                    s["cached"] / s["prompt"], abs=1e-4
                )
                assert view["replicas"][replica]["hit_rate_predicted"] is not None
                assert view["replicas"][replica]["engine_hit_rate"] is not None
        state = view["policy_state"]
        assert state["ring"]["members"] == ["r0", "r1", "r2", "r3"]
        assert state["affinity"]["entries"] > 0

        line, fields = lines[route]
        assert percent(line, "Prefix cache hit rate") == f"{t['cached'] / t['prompt'] * 100:.1f}%"
        assert percent(line, "Predicted hit rate") == f"{view['predicted_cached_tokens'] / t['prompt'] * 100:.1f}%"
        # demo-model has no known family: the gateway's tokens are cl100k over a generic template
        assert percent(line, "Predicted units") == GUESSED
        assert view["predicted_units"] == GUESSED and view["predicted_exact"] is False
        assert percent(line, "Engine hit rate") == f"{fleet_cached / fleet_prompt * 100:.1f}%"
        assert fields["hit_rate_reported"] == pytest.approx(t["cached"] / t["prompt"])
