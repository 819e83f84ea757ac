"""POST /admin/explain and `prefix-gateway explain`: the documented report, computed on the
handler's own code path without sending anything or changing any routing state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from e2e_helpers import (
    ADMIN_KEY,
    MODEL,
    Conversation,
    admin,
    ask,
    client,
    gateway,
    metric_sum,
    prefix_route,
    prompt_tokens_of,
    whole_blocks,
)

from gateway.cli import main
from gateway.config import sha256_hex
from gateway.sim.launcher import ReplicaGroup

STAMPED = {
    "role": "system",
    "content": "Now: 2025-03-04T05:06:07Z, trace 550e8400-e29b-41d4-a716-446655440000.\n"
    + "You answer questions about trains. " * 30,
}
REPLICA_FIELDS = {
    "replica",
    "healthy",
    "eligible",
    "weight",
    "in_flight",
    "chosen",
    "engine",
    "ring_rank",
    "bound",
    "under_bound",
    "matched_blocks",
}


# Move detected values on first sight (explain of a learned route is in test_e2e_normalize_learn.py).
ALWAYS = prefix_route(normalize={"mode": "relocate", "always": ["*"]})


# demo-model has no known family: cl100k_base is a guess, over the generic template
GUESSED = (
    "approximate (cl100k_base): tokenizer cl100k_base guessed from the model name; "
    "template chatml-like (not the model's)"
)


def engine_queries(urls: list[str]) -> float:
    return sum(metric_sum(httpx.get(f"{url}/metrics").text, "vllm:prefix_cache_queries_total") for url in urls)


def test_explain_shows_the_plan_and_the_handler_follows_it(
    fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    conv = Conversation("trains", messages=[STAMPED])
    with gateway(fleet.urls, routes=[ALWAYS]) as gw, admin(gw) as api:
        ask_first = [*conv.messages, {"role": "user", "content": "Hi? (about trains)"}]  # what conv.turn sends
        first = api.post("/admin/explain", json={"model": MODEL, "messages": ask_first})
        assert first.status_code == 200, first.text
        assert engine_queries(fleet.urls) == 0  # nothing was sent upstream
        assert metric_sum(httpx.get(f"{gw.url}/metrics").text, "prefix_gateway_requests_total") == 0
        report = first.json()
        assert report["dry_run"] is True and report["endpoint"] == "chat" and report["model"] == MODEL
        assert report["route"] == {
            "name": "main",
            "policy": "prefix",
            "normalize": "relocate",
            "replicas": ["r0", "r1", "r2", "r3"],
        }
        norm = report["normalize"]
        assert norm["mode"] == "relocate" and norm["rewritten"] is True
        assert norm["counts"] == {"iso_datetime": 1, "uuid": 1} and norm["spans_moved"] == 2
        assert {(c["where"], c["rule"], c["value"], c["placeholder"]) for c in norm["changes"]} == {
            ("messages[0].content", "iso_datetime", "2025-03-04T05:06:07Z", "{{volatile:iso_datetime:1}}"),
            ("messages[0].content", "uuid", "550e8400-e29b-41d4-a716-446655440000", "{{volatile:uuid:1}}"),
        }
        assert "2025-03-04T05:06:07Z" in report["forwarded_body"]["messages"][-1]["content"]
        prefix = report["prefix"]
        assert prefix["tokenizer"] == "auto" and prefix["block_size"] == 16 and prefix["window_limit"] == 4096
        assert prefix["units"] == GUESSED  # demo-model: no known family
        assert prefix["blocks"] == prefix["window_tokens"] // 16 and prefix["blocks"] > 16
        assert report["key"]["source"] == "block" and report["key"]["depth_blocks"] == 16
        assert len(report["key"]["value"]) == 16
        rows = report["replicas"]
        assert [r["replica"] for r in rows] == ["r0", "r1", "r2", "r3"]
        assert all(set(r) >= REPLICA_FIELDS and r["healthy"] and r["in_flight"] == 0 for r in rows)
        assert sorted(r["ring_rank"] for r in rows) == [0, 1, 2, 3]
        decision = report["decision"]
        assert decision["reason"] == "ring" and decision["predicted_cached_tokens"] == 0
        assert [r["replica"] for r in rows if r["chosen"]] == [decision["replica"]]
        assert decision["replica"] in decision["why"]

        turn1 = conv.turn(client(gw), "Hi?")
        assert turn1.replica == decision["replica"]  # the handler did what explain said

        conv.messages.append({"role": "user", "content": "And tomorrow? (about trains)"})
        wrapped = {"endpoint": "chat", "body": {"model": MODEL, "messages": conv.messages}, "headers": {}}
        second = api.post("/admin/explain", json=wrapped).json()
        conv.messages.pop()
        assert second["decision"]["reason"] == "affinity" and second["decision"]["replica"] == turn1.replica
        home = next(r for r in second["replicas"] if r["replica"] == turn1.replica)
        assert home["matched_blocks"] > 0 and home["score"] > 0
        predicted = second["decision"]["predicted_cached_tokens"]
        # turn 1's values block sat in its last user message: turn 2 shares the stable system prompt
        stable = {"role": "system", "content": report["forwarded_body"]["messages"][0]["content"]}
        assert predicted >= whole_blocks(prompt_tokens_of([stable])) - 48  # the index keeps every 4th block
        turn2 = conv.turn(client(gw), "And tomorrow?")
        assert turn2.replica == turn1.replica and turn2.cached_tokens >= predicted

        completions = api.post("/admin/explain", json={"model": MODEL, "prompt": "2025-03-04 Once upon a time"}).json()
        assert completions["endpoint"] == "completions" and completions["normalize"]["counts"] == {"date": 1}
        embeddings = api.post("/admin/explain", json={"model": MODEL, "input": "hello"}).json()
        assert embeddings["endpoint"] == "embeddings" and embeddings["key"] is None and embeddings["normalize"] is None


@pytest.mark.slow
def test_explain_changes_no_routing_state(fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same real requests land on the same replicas with or without explain calls in between."""
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    routes = [
        {
            "name": "rr",
            "match": {"models": [MODEL], "header": {"name": "x-route", "values": ["rr"]}},
            "policy": "round_robin",
        },
        prefix_route(),
    ]
    steps: list[tuple[dict[str, str], list[dict[str, Any]]]] = []
    for i in range(12):
        kind = i % 4
        if kind == 0:  # a new long prefix, then the same conversation grows
            steps.append(
                (
                    {},
                    [
                        {"role": "system", "content": f"Desk {i}. " + "Be useful. " * 60},
                        {"role": "user", "content": "Hello"},
                    ],
                )
            )
        elif kind == 1:
            prev = steps[-1][1]
            steps.append(({}, [*prev, {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "More"}]))
        elif kind == 2:  # one short prompt again and again (the fallback turn is covered in test_e2e_dry_run)
            steps.append(({}, [{"role": "user", "content": "ok"}]))
        else:
            steps.append(({"x-route": "rr"}, [{"role": "user", "content": f"round {i}"}]))

    def run(explain: bool) -> list[str]:
        placed = []
        with gateway(fleet.urls, routes=routes) as gw, admin(gw) as api:
            for headers, messages in steps:
                if explain:
                    body = {"endpoint": "chat", "body": {"model": MODEL, "messages": messages}, "headers": headers}
                    state = api.get("/admin/stats").json()["routes"]["main"]["policy_state"]
                    said = [api.post("/admin/explain", json=body).json()["decision"]["replica"] for _ in range(3)]
                    assert api.get("/admin/stats").json()["routes"]["main"]["policy_state"] == state
                    assert len(set(said)) == 1
                reply = ask(client(gw, **headers), messages)
                if explain:
                    assert reply.replica == said[0]
                placed.append(reply.replica)
        return placed

    assert run(explain=True) == run(explain=False)


def test_explain_needs_the_admin_key_and_answers_bad_input_with_400(
    fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    monkeypatch.delenv("PREFIX_GATEWAY_ADMIN_KEY", raising=False)
    with gateway(fleet.urls[:1]) as gw:
        off = httpx.post(f"{gw.url}/admin/explain", json=body)
        assert off.status_code == 404 and off.json()["error"]["code"] == "admin_disabled"
    with gateway(fleet.urls[:1], admin={"api_key_sha256": sha256_hex(ADMIN_KEY)}) as gw:
        assert httpx.post(f"{gw.url}/admin/explain", json=body).status_code == 401
        assert admin(gw, "wrong").post("/admin/explain", json=body).status_code == 401
        with admin(gw) as api:
            assert api.post("/admin/explain", json=body).status_code == 200
            for bad in (
                b"{not json",
                b"[]",
                b'{"model": "demo-model"}',
                b'{"endpoint": "chat", "body": {"model": "demo-model"}}',
                b'{"endpoint": "images", "body": {}}',
                b'{"model": "demo-model", "messages": "hi"}',
                b"",
            ):
                answer = api.post("/admin/explain", content=bad, headers={"content-type": "application/json"})
                assert answer.status_code == 400, (bad, answer.text)
                error = answer.json()["error"]
                assert error["type"] == "invalid_request_error" and error["message"], bad
            unknown = api.post("/admin/explain", json={**body, "model": "nope"})
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_cli_explain_against_a_gateway_and_offline(
    fleet: ReplicaGroup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": MODEL, "messages": [STAMPED, {"role": "user", "content": "Next train?"}]}))
    offline_config = tmp_path / "gateway.yaml"
    offline_config.write_text(
        yaml.safe_dump(
            {
                "replicas": [
                    {"name": f"r{i}", "url": f"http://127.0.0.1:{9 + i}"} for i in range(4)
                ],  # nothing listens
                "routes": [ALWAYS],
            }
        )
    )

    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    with gateway(fleet.urls, routes=[ALWAYS]) as gw:
        assert main(["explain", str(request), "--gateway", gw.url]) == 0
        text = capsys.readouterr().out
        assert main(["explain", str(request), "--gateway", gw.url + "/v1", "--json"]) == 0
        remote = json.loads(capsys.readouterr().out)
        assert main(["explain", str(request), "--gateway", gw.url, "--admin-key", "wrong"]) == 1
        assert "401" in capsys.readouterr().err
        assert engine_queries(fleet.urls) == 0
    chosen = remote["decision"]["replica"]
    assert "route: main  policy=prefix  normalize=relocate" in text
    assert "normalization (relocate): volatile spans moved: iso_datetime=1, uuid=1" in text
    assert "2025-03-04T05:06:07Z" in text and "{{volatile:uuid:1}}" in text
    assert f"key: {remote['key']['value']} (chain key of block 16 = the first 256 tokens)" in text
    assert f"decision: {chosen} (ring), predicted cached tokens: 0" in text
    assert next(line for line in text.splitlines() if line.endswith("<- chosen")).split()[0] == chosen

    monkeypatch.delenv("PREFIX_GATEWAY_ADMIN_KEY")
    assert main(["explain", str(request), "--config", str(offline_config)]) == 0
    offline = capsys.readouterr().out
    assert offline.startswith("(offline plan from ")
    assert f"decision: {chosen} (ring)" in offline  # same membership, idle: the same choice as the gateway
    assert (
        main(["explain", str(request), "--config", str(offline_config), "--json", "--header", "x-session-id=abc"]) == 0
    )
    session = json.loads(capsys.readouterr().out)
    assert session["key"]["source"] == "session" and session["session_key"] is True
    request.write_text(json.dumps({"model": "unknown-model", "prompt": "hi"}))
    assert main(["explain", str(request), "--config", str(offline_config)]) == 1
    assert "404" in capsys.readouterr().err
