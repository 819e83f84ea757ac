"""Dry-run planning (what /admin/explain uses) changes nothing; explain input parsing; membership."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from e2e_helpers import MODEL, config, prefix_route

from gateway.admin.explain import explain, offline_gateway, parse_input
from gateway.errors import BadRequest
from gateway.routing.base import ReplicaView, RequestView
from gateway.routing.policies.prefix import PrefixPolicy, PrefixPolicySettings

URLS = [f"http://127.0.0.1:{9 + i}" for i in range(4)]  # never contacted
NAMES = ["r0", "r1", "r2", "r3"]


def request(keys: tuple[int, ...], rid: str = "") -> RequestView:
    return RequestView(rid, "main", MODEL, "chat", block_keys=keys, block_size=16, prompt_tokens=16 * len(keys) + 3)


def test_peek_equals_choose_and_records_nothing() -> None:
    policy = PrefixPolicy(PrefixPolicySettings(), [ReplicaView(n) for n in NAMES])
    views = [ReplicaView(n) for n in NAMES]
    first = request(tuple(range(1, 41)))
    placed = policy.choose(first, views)
    before = policy.snapshot()
    follow_up = request(tuple(range(1, 61)))  # extends the first prompt: affinity
    peeked = [policy.peek(follow_up, views) for _ in range(3)]
    assert policy.snapshot() == before  # the affinity index did not learn the peeked request
    assert all(p == peeked[0] for p in peeked)
    assert peeked[0].reason == "affinity" and peeked[0].replica == placed.replica
    real = policy.choose(follow_up, views)
    assert (real.replica, real.reason) == (peeked[0].replica, peeked[0].reason)
    # the real decision carries the cheap fields only; peek adds the explain table on top
    # recorded_keys, work: what choose() added to the index and the work meter (taken back if
    # the attempt fails); withdrawals: the policy's count of those at the decision (for observe)
    cheap = {k: v for k, v in real.detail.items() if k not in ("recorded_keys", "work", "withdrawals")}
    assert cheap.items() <= peeked[0].detail.items()
    assert policy.snapshot() != before
    short = RequestView("", "main", MODEL, "chat")  # no keys: least loaded, ties by a turn counter
    peeks = {policy.peek(short, views).replica for _ in range(4)}
    assert len(peeks) == 1 and policy.choose(short, views).replica == peeks.pop()  # the turn did not advance


@pytest.mark.parametrize("policy", ["round_robin", "random", "least_loaded", "prefix"])
def test_dry_run_decisions_do_not_advance_any_policy(policy: str) -> None:
    route = {"name": "main", "policy": policy} | ({"policy_settings": {"seed": 7}} if policy == "random" else {})
    gateway = offline_gateway(config(URLS, [route]))
    body: dict[str, Any] = {"model": MODEL, "prompt": "hi"}
    for _ in range(6):
        dry = [gateway.plan("completions", body, {}, dry_run=True).replica.name for _ in range(3)]
        assert len(set(dry)) == 1
        assert gateway.plan("completions", body, {}).replica.name == dry[0]  # what explain said happens


def test_set_replicas_keeps_the_policy_ring_in_step() -> None:
    gateway = offline_gateway(config(URLS, [prefix_route()]))
    runner = gateway.routes.get("main").runner
    assert runner.policy.ring.members == NAMES  # the full membership at build time
    runner.set_replicas(runner.replicas[:3])
    assert runner.policy.ring.members == NAMES[:3]
    assert {
        gateway.plan(
            "chat", {"model": MODEL, "messages": [{"role": "user", "content": f"q{i} " * 20}]}, {}
        ).replica.name
        for i in range(20)
    } <= set(NAMES[:3])


def test_explain_input_forms() -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert parse_input(chat).endpoint == "chat"
    assert parse_input({"model": MODEL, "prompt": "hi"}).endpoint == "completions"
    assert parse_input({"model": MODEL, "input": "hi"}).endpoint == "embeddings"
    wrapped = parse_input({"endpoint": "/v1/chat/completions", "body": chat, "headers": {"X-Session-Id": "s"}})
    assert wrapped.endpoint == "chat" and wrapped.headers == {"x-session-id": "s"} and wrapped.body == chat
    assert parse_input({"body": {"model": MODEL, "prompt": [1, 2, 3]}}).endpoint == "completions"
    for bad in (
        [chat],
        {"model": MODEL},
        {"endpoint": "images", "body": chat},
        {"endpoint": "chat", "body": {"model": MODEL}},
        {"endpoint": "chat", "body": chat, "extra": 1},
        {"body": "text"},
        {"body": chat, "headers": {"x": 1}},
        {"model": MODEL, "messages": "hi"},
    ):
        with pytest.raises(BadRequest):
            parse_input(bad)


def test_startup_preloads_the_tokenizers_of_prefix_routes() -> None:
    """The first request must not pay for loading a vocabulary (~0.4 s): start() does it."""
    llama = "meta-llama/Llama-3.1-8B-Instruct"
    routes = [
        prefix_route("named", match={"models": [llama]}),
        prefix_route("any", match={"models": ["*"]}),
    ]
    gateway = offline_gateway(config(URLS, routes))
    pipelines = {r.name: r.pipeline for r in gateway.routes.routes}
    assert all(not p.tokens._by_model for p in pipelines.values() if p is not None)
    gateway._warm_pipelines()
    assert set(pipelines["named"].tokens._by_model) == {llama}  # type: ignore[union-attr]
    assert set(pipelines["any"].tokens._by_model) == {""}  # type: ignore[union-attr]  # the fallback vocabulary
    assert gateway.routes.get("named").runner.policy.snapshot()["affinity"]["keys"] == 0  # nothing recorded


def test_explain_names_the_flow_of_a_client_key_as_the_proxy_would() -> None:
    """A configured client key in the explained request's headers names its flow (what the
    prefix policy's own-flow copy rule and flow control read); an unknown key names none."""
    key = "client-key-1"
    auth = {"api_keys_sha256": [hashlib.sha256(key.encode()).hexdigest()]}
    gateway = offline_gateway(config([f"http://127.0.0.1:{9000 + i}" for i in range(4)], auth=auth))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 40}]}

    def flow_of(authorization: str) -> str:
        return explain(gateway, parse_input({"body": chat, "headers": {"Authorization": authorization}}))[
            "flow_control"
        ]["flow"]

    assert flow_of(f"Bearer {key}") == "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    assert flow_of("Bearer not-a-key") == "route:main"
