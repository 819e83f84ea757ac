"""The seams the prefix engine plugs into: registry entry, pipeline call, RequestView keys,
normalization header and metrics, predicted cached tokens, observe() feedback, Gateway.plan."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import httpx
import pytest
from gw_helpers import MODEL, client, gateway_config, metric_sum, running_gateway, wait_for

from gateway.prefix.pipeline import PrefixPipeline, PreparedPrompt
from gateway.routing import registry, routes
from gateway.routing.base import Decision, PolicySettings, ReplicaView, RequestView
from gateway.service import Gateway

SEEN: list[RequestView] = []
OBSERVED: list[tuple[str, int | None]] = []


class KeyedSettings(PolicySettings):
    predicted: int = 7


class KeyedPolicy:
    """Stands in for the prefix policy: records what it gets, predicts a fixed hit."""

    name: ClassVar[str] = "keyed"

    def __init__(self, settings: KeyedSettings, members: Sequence[ReplicaView]) -> None:
        self.settings = settings
        self.members = [m.name for m in members]

    def choose(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        SEEN.append(request)
        return self.peek(request, replicas)

    def peek(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        return Decision(replicas[0].name, "ring", {"predicted_cached_tokens": self.settings.predicted})

    def set_members(self, members: Sequence[ReplicaView]) -> None:
        self.members = [m.name for m in members]

    def observe(self, request: RequestView, decision: Decision, cached_tokens: int | None) -> None:
        OBSERVED.append((decision.replica, cached_tokens))


class RelocatingPipeline(PrefixPipeline):
    """The real stub pipeline plus a pretend relocation (what the full prefix helper will do)."""

    def prepare(self, endpoint: str, body: dict[str, Any], *, learn: bool = True) -> PreparedPrompt:
        prepared = super().prepare(endpoint, body, learn=learn)
        if self.normalize_settings.mode != "relocate":
            return prepared
        rewritten = {**body, "messages": [*body["messages"], {"role": "user", "content": "[moved: 2024-01-01]"}]}
        return dataclasses.replace(prepared, body=rewritten, normalized={"iso_datetime": 1}, relocated=True)


@pytest.fixture(autouse=True)
def keyed_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.POLICIES, "keyed", registry.PolicyEntry(KeyedPolicy, KeyedSettings, True))
    monkeypatch.setattr(routes, "PrefixPipeline", RelocatingPipeline)
    SEEN.clear()
    OBSERVED.clear()


LONG = [{"role": "system", "content": "You are a careful assistant. " * 40}, {"role": "user", "content": "hi"}]


def keyed_route(**extra: Any) -> list[dict[str, Any]]:
    return [{"name": "agents", "policy": "keyed", "prefix": {"block_size": 16}, **extra}]


def test_plan_is_the_handlers_code_path_without_sending(sim_urls: list[str]) -> None:
    gateway = Gateway(gateway_config(sim_urls, routes=keyed_route()))
    plan = gateway.plan("chat", {"model": MODEL, "messages": LONG}, {"x-session-id": "s1"}, "rid-1")
    assert plan.route.name == "agents" and plan.replica.name == "r0"
    assert plan.request.block_size == 16 and len(plan.request.block_keys) >= 10
    assert plan.request.prompt_tokens == plan.prepared.window_tokens
    assert plan.request.session_key == "s1" and plan.request.request_id == "rid-1"
    assert plan.decision.reason == "ring" and plan.predicted_cached_tokens == 7
    assert plan.replica.in_flight == 0  # planning holds no slot
    embeddings = gateway.plan("embeddings", {"model": MODEL, "input": "x"}, {})
    assert embeddings.prepared is None and embeddings.request.block_keys == ()


def test_keys_reach_the_policy_and_the_outcome_feeds_back(sim_urls: list[str]) -> None:
    with running_gateway(sim_urls[:2], routes=keyed_route()) as gw:
        for _ in range(2):
            raw = client(gw).chat.completions.with_raw_response.create(model=MODEL, messages=LONG, max_tokens=2)
        reply = raw.parse()
        assert "x-prefix-gateway-normalized" not in raw.headers  # mode "report": nothing moved
        text = httpx.get(f"{gw.url}/metrics").text
    assert SEEN[0].block_keys and SEEN[0].block_keys == SEEN[1].block_keys
    assert [replica for replica, _ in OBSERVED] == ["r0", "r0"]
    assert OBSERVED[1][1] == reply.usage.prompt_tokens_details.cached_tokens
    assert OBSERVED[1][1] > 0  # the second request hit the cache and the policy learned it
    assert metric_sum(text, "prefix_gateway_predicted_cached_tokens_total", route="agents", replica="r0") == 14
    assert metric_sum(text, "prefix_gateway_decisions_total", route="agents", policy="keyed", reason="ring") == 2


def test_relocation_rewrites_the_body_and_is_reported(echo_url: str) -> None:
    with running_gateway([echo_url], routes=keyed_route(normalize={"mode": "relocate"})) as gw:
        raw = client(gw).chat.completions.with_raw_response.create(model=MODEL, messages=LONG)
        forwarded = raw.parse().model_extra["echo"]["body"]
        text = httpx.get(f"{gw.url}/metrics").text
    assert raw.headers["x-prefix-gateway-normalized"] == "iso_datetime=1"
    assert forwarded["messages"][-1] == {"role": "user", "content": "[moved: 2024-01-01]"}
    labels = {"route": "agents", "rule": "iso_datetime", "mode": "relocate"}
    assert metric_sum(text, "prefix_gateway_normalize_spans_total", **labels) == 1


def test_relocated_streams_still_get_usage_added_and_stripped(sim_urls: list[str]) -> None:
    with running_gateway(sim_urls[:1], routes=keyed_route(normalize={"mode": "relocate"})) as gw:
        chunks = list(client(gw).chat.completions.create(model=MODEL, messages=LONG, max_tokens=3, stream=True))
        # the gateway records a request after its last byte is sent: the client can be faster
        stats = wait_for(lambda: gw.gateway.stats.by_route.get("agents"), what="the stream's outcome")
    assert all(ch.usage is None for ch in chunks)
    assert stats.prompt_tokens > 0  # usage was learned from the stream anyway


def test_the_flow_a_client_names_reaches_the_policy(sim_urls: list[str]) -> None:
    """The fairness header (else the client's key) names the request's flow for routing too,
    whether or not flow control is on; an anonymous request has none."""
    with running_gateway(sim_urls[:2], routes=keyed_route()) as gw:
        sdk = client(gw)
        sdk.chat.completions.create(
            model=MODEL, messages=LONG, max_tokens=2, extra_headers={"x-llm-d-inference-fairness-id": "tenant-a"}
        )
        sdk.chat.completions.create(model=MODEL, messages=LONG, max_tokens=2)
    assert [view.flow for view in SEEN] == ["id:tenant-a", None]
    gateway = Gateway(gateway_config(sim_urls, routes=keyed_route()))
    plan = gateway.plan("chat", {"model": MODEL, "messages": LONG}, {}, key_hash="ab" * 32)
    assert plan.request.flow == "key:" + "ab" * 8
