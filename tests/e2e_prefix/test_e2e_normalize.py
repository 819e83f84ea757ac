"""A leading timestamp in the system prompt: cache hits with ``relocate``, none with ``off``,
and the model still receives the value (checked through an upstream that echoes its input).

``relocate`` moves a detected value once it has been seen to change: the first request keeps
it in place (a warm-up miss), the second moves it, the third and later hit the cache."""

from __future__ import annotations

from typing import Any

import pytest
from e2e_helpers import BLOCK, MODEL, ask, client, gateway, prefix_route, prompt_tokens_of, whole_blocks

from gateway.sim.launcher import ReplicaGroup

POLICY = "You are the scheduling assistant of a small clinic. " + "Be brief and kind to every patient. " * 40


def system_at(minute: int) -> dict[str, str]:
    return {"role": "system", "content": f"Current date and time: 2025-03-04T09:{minute:02d}:17Z.\n{POLICY}"}


def by_header(name: str, mode: str) -> dict[str, Any]:
    return prefix_route(name, mode, match={"models": [MODEL], "header": {"name": "x-normalize", "values": [mode]}})


@pytest.mark.slow
def test_timestamps_hit_the_cache_with_relocate_and_miss_with_off(fleet: ReplicaGroup) -> None:
    question = {"role": "user", "content": "Can I book an appointment for tomorrow morning?"}
    stable = {
        "role": "system",
        "content": system_at(0)["content"].replace("2025-03-04T09:00:17Z", "{{volatile:iso_datetime:1}}"),
    }
    stable_blocks = whole_blocks(prompt_tokens_of([stable]))
    assert stable_blocks >= 320
    with gateway(fleet.urls, routes=[by_header("moved", "relocate"), by_header("kept", "off")]) as gw:
        moved = [ask(client(gw, **{"x-normalize": "relocate"}), [system_at(m), question]) for m in range(6)]
        kept = [ask(client(gw, **{"x-normalize": "off"}), [system_at(30 + m), question]) for m in range(6)]
    assert {r.route for r in moved} == {"moved"} and {r.route for r in kept} == {"kept"}
    assert "x-prefix-gateway-normalized" not in moved[0].headers  # first sight: not known to vary yet
    assert all(r.headers["x-prefix-gateway-normalized"] == "iso_datetime=1" for r in moved[1:])
    assert all("x-prefix-gateway-normalized" not in r.headers for r in kept)
    for reply in moved[2:]:
        assert reply.cached_tokens is not None and reply.cached_tokens >= stable_blocks, reply
    for reply in kept:  # every prompt differs from the timestamp on: at most the template's first block
        assert reply.cached_tokens is not None and reply.cached_tokens <= BLOCK, reply


def test_the_model_still_receives_the_relocated_value(echo_url: str) -> None:
    messages = [system_at(5), {"role": "user", "content": "When do you open?"}]
    with gateway([echo_url], routes=[prefix_route("main", "relocate")]) as gw:
        first = [system_at(4), messages[1]]
        client(gw).chat.completions.create(model=MODEL, messages=first)  # learns the value's place
        raw = client(gw).chat.completions.with_raw_response.create(model=MODEL, messages=messages)
        forwarded = raw.http_response.json()["echo"]["body"]["messages"]
    assert "2025-03-04T09:05:17Z" not in forwarded[0]["content"]
    assert forwarded[0]["content"].startswith("Current date and time: {{volatile:iso_datetime:1}}.\n")
    assert forwarded[1]["content"].startswith('When do you open?\n\n<volatile_values check="')
    assert "{{volatile:iso_datetime:1}} = 2025-03-04T09:05:17Z" in forwarded[1]["content"]
    assert raw.headers["x-prefix-gateway-normalized"] == "iso_datetime=1"
    with gateway([echo_url], routes=[prefix_route("main", "off")]) as gw:
        raw = client(gw).chat.completions.with_raw_response.create(model=MODEL, messages=messages)
        assert raw.http_response.json()["echo"]["body"]["messages"] == messages  # forwarded untouched
