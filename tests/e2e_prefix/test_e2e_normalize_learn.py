"""Normalization v2 end to end (issue 9): through the gateway, simulated replicas and the openai SDK.

- A CJK timestamp and a ``req_…`` id that change every request are learned — by the detectors
  plus the learner of what varies, and with every detector off by discovery alone — and hit
  the cache on >= 90 % of the prompt after the first 3 requests; the learned spans, their
  shapes and suggested rules appear in ``/admin/stats`` and explain.
- An agent tool loop with a fresh timestamp on top reuses >= 95 % of the previous step's
  prompt from step 3 on.
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
from e2e_helpers import ADMIN_KEY, MODEL, admin, ask, client, gateway, metric_sum, prefix_route

from gateway.sim.launcher import ReplicaGroup

POLICY = "You are the travel desk of a small agency. Answer briefly and check every date twice. " * 110  # ~2k tokens


def system(i: int, rng: random.Random) -> dict[str, str]:
    stamp = f"2025年3月4日17:{i // 60 % 60:02d}:{i % 60:02d}"
    rid = "req_" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(9)) + str(i % 10)
    return {"role": "system", "content": f"现在是{stamp}，请求 {rid}。\n{POLICY}"}  # noqa: RUF001 (CJK comma)


def by_header(name: str, normalize: dict[str, Any]) -> dict[str, Any]:
    return prefix_route(
        name, match={"models": [MODEL], "header": {"name": "x-route", "values": [name]}}, normalize=normalize
    )


@pytest.mark.parametrize(
    ("route", "normalize", "rules"),
    [
        ("detected", {"mode": "relocate"}, {"date", "prefixed_id"}),
        ("discovered", {"mode": "relocate", "detectors": []}, {"learned"}),
    ],
)
@pytest.mark.slow
def test_changing_cjk_timestamp_and_request_id_are_learned_and_hit(
    fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch, route: str, normalize: dict[str, Any], rules: set[str]
) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    rng = random.Random(5)
    question = {"role": "user", "content": "Is my train on time?"}
    with gateway(fleet.urls, routes=[by_header(route, normalize)]) as gw, admin(gw) as api:
        sdk = client(gw, **{"x-route": route})
        replies = [ask(sdk, [system(i, rng), question]) for i in range(15)]
        stats = api.get("/admin/stats").json()["routes"][route]["normalization"]
        body = {"model": MODEL, "messages": [system(99, rng), question]}
        explained = api.post("/admin/explain", json={"endpoint": "chat", "body": body, "headers": {"x-route": route}})
        explained = explained.json()
        scraped = httpx.get(f"{gw.url}/metrics").text
    later = replies[3:]
    hit = sum(r.cached_tokens or 0 for r in later) / sum(r.prompt_tokens for r in later)
    assert hit >= 0.90, [(r.cached_tokens, r.prompt_tokens) for r in replies]
    assert replies[0].cached_tokens == 0  # nothing known yet: the first request misses

    learned = [x for x in stats["learned"] if x["rule"] in rules]
    assert len(learned) == 2, stats
    assert {x["rule"] for x in learned} == rules
    patterns = {x["suggested_rule"]["pattern"] for x in learned}
    assert r"\d{4}年\d{1,2}月\d{1,2}日\d{1,2}:\d{1,2}:\d{1,2}" in patterns, patterns
    assert r"[a-z]{3}_[a-z0-9]{10}" in patterns, patterns
    for x in learned:
        assert x["where"].startswith("messages[0].content ctx=") and x["changes"] >= 10
        assert x["suggested_rule"]["name"].startswith("pin_")
    assert stats["mode"] == "relocate" and stats["warmup_misses"] >= 1
    misses = metric_sum(scraped, "prefix_gateway_normalize_warmup_misses_total", route=route)
    assert misses == stats["warmup_misses"]
    assert metric_sum(scraped, "prefix_gateway_normalize_learned_places", route=route) >= 2
    dumped = json.dumps(stats, ensure_ascii=False)
    assert "req_" not in dumped and "请求" not in dumped and "2025" not in dumped  # shapes, no prompt text

    norm = explained["normalize"]
    assert {c["rule"] for c in norm["changes"]} == rules
    assert {x["suggested_rule"]["pattern"] for x in norm["learned"] if x["rule"] in rules} == patterns


def test_tool_loop_with_a_fresh_timestamp_keeps_the_previous_step_cached(fleet: ReplicaGroup) -> None:
    task = {"role": "user", "content": "Find the three cheapest trains to Lyon next week and book one."}
    history: list[dict[str, Any]] = []
    replies = []
    with gateway(fleet.urls, routes=[prefix_route("main", "relocate")]) as gw:
        sdk = client(gw)
        for step in range(10):
            head = {"role": "system", "content": f"Current time: 2025-03-04T09:{step:02d}:17Z.\n{POLICY}"}
            replies.append(ask(sdk, [head, task, *history]))
            call = {
                "id": f"c{step}",
                "type": "function",
                "function": {"name": "search", "arguments": f'{{"p": {step}}}'},
            }
            history += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {
                    "role": "tool",
                    "tool_call_id": f"c{step}",
                    "content": f"Trains page {step}: " + "TGV 08:10 49 EUR; " * 30,
                },
            ]
    for k in range(2, 10):  # step 3 on: step k+1 reuses step k's prompt
        reuse = (replies[k].cached_tokens or 0) / replies[k - 1].prompt_tokens
        assert reuse >= 0.95, (k, [(r.cached_tokens, r.prompt_tokens) for r in replies])
