"""Gateway vs engine tokenization, end to end: what misalignment costs, and that stats show it.

Four simulated replicas serve ``meta-llama/Llama-3.1-8B-Instruct`` with their *own* tokenizer
and chat template (llama3 vocabulary, Meta's published template, specials parsed: as vLLM).
The gateway either keys the prompts over cl100k_base and its generic template (misaligned), or
with ``tokenizer: auto``, which reads the Llama 3.1 family from the model name (aligned).
Either way conversations must keep their replica and the fleet's hit rate must stay within
2 points; ``/admin/stats`` must say the misaligned prediction is approximate and show the gap.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from e2e_helpers import ADMIN_KEY, SIM_OPTIONS, admin, client, gateway

from gateway.sim.launcher import ReplicaGroup
from tests.replica_fleet import fresh, shared_group

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
SIMS = {**SIM_OPTIONS, "tokenizer": "llama3", "model": LLAMA}  # the replicas' own tokenizer and template
TOPICS = ["astronomy", "baking", "chess", "diving", "etching", "falconry", "gardening", "hiking"]
QUESTIONS = ["Where do I start?", "What tools do I need?", "How do I practise?", "What comes next?", "Any tips?"]


def system(topic: str) -> str:
    head = f"You are the assistant for the {topic} desk. Be concise and kind. "
    return head + f"Answer {topic} questions well. " * 30


def run(group: ReplicaGroup, tokenizer: str) -> tuple[dict[str, list[str]], int, int, dict[str, Any]]:
    """Eight interleaved 5-turn conversations over ``group`` (as just started: empty caches);
    (replicas per conversation, prompt, cached, route stats)."""
    route = {
        "name": "main",
        "match": {"models": [LLAMA]},
        "policy": "prefix",
        "normalize": {"mode": "off"},
        "prefix": {"tokenizer": tokenizer},
    }
    replicas: dict[str, list[str]] = {t: [] for t in TOPICS}
    prompt = cached = 0
    # a lenient health check: on a busy machine a slow probe must not eject a replica mid-run
    health = {"timeout_s": 5.0, "unhealthy_threshold": 3}
    with gateway(fresh(group).urls, routes=[route], health=health) as gw:
        sdk = client(gw)
        histories = {
            t: [{"role": "system", "content": system(t)}, {"role": "user", "content": f"I want to learn {t}."}]
            for t in TOPICS
        }
        for question in QUESTIONS:
            for topic in TOPICS:
                messages = histories[topic]
                raw = sdk.chat.completions.with_raw_response.create(model=LLAMA, messages=messages, max_tokens=8)
                reply = raw.parse()
                replicas[topic].append(raw.headers["x-prefix-gateway-replica"])
                assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
                prompt += reply.usage.prompt_tokens
                cached += reply.usage.prompt_tokens_details.cached_tokens or 0
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
                messages.append({"role": "user", "content": f"{question} ({topic})"})
        with admin(gw, ADMIN_KEY) as api:
            stats = api.get("/admin/stats").json()["routes"]["main"]
    return replicas, prompt, cached, stats


def stable_turns(replicas: dict[str, list[str]]) -> float:
    """Share of turns (after the first) that went where the conversation's previous turn went."""
    same = sum(a == b for turns in replicas.values() for a, b in itertools.pairwise(turns))
    return same / sum(len(turns) - 1 for turns in replicas.values())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, list[str]], int, int, dict[str, Any]]]:
    # one set of replica processes, reset between the two runs (tests/replica_fleet.py)
    with (
        pytest.MonkeyPatch.context() as mp,
        shared_group(tmp_path_factory, "alignment-sims", 4, **SIMS) as group,
    ):
        mp.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
        return {name: run(group, name) for name in ("cl100k_base", "auto")}


@pytest.mark.slow
def test_misaligned_gateway_still_keeps_conversations_together(runs) -> None:
    for name in ("cl100k_base", "auto"):
        replicas = runs[name][0]
        assert stable_turns(replicas) >= 0.95, (name, replicas)
        assert len({turns[-1] for turns in replicas.values()}) >= 3, (name, replicas)  # spread, not piled


@pytest.mark.slow
def test_hit_rate_within_two_points_of_the_aligned_run(runs) -> None:
    _, p_mis, c_mis, _ = runs["cl100k_base"]
    _, p_al, c_al, _ = runs["auto"]
    assert p_mis == p_al  # the engines count the same prompts either way
    mis, aligned = c_mis / p_mis, c_al / p_al
    print(f"hit rate: misaligned {mis:.4f}, aligned {aligned:.4f}")
    assert aligned > 0.6
    assert abs(aligned - mis) <= 0.02, (mis, aligned)


@pytest.mark.slow
def test_stats_show_units_and_the_predicted_vs_reported_gap(runs) -> None:
    mis = runs["cl100k_base"][3]
    aligned = runs["auto"][3]
    assert (
        mis["predicted_units"] == "approximate (cl100k_base): template chatml-like (not the model's)"
        and mis["predicted_exact"] is False
    )
    assert aligned["predicted_units"] == "exact (llama3)" and aligned["predicted_exact"] is True
    for view in (mis, aligned):
        assert view["hit_rate_gap"] == pytest.approx(view["hit_rate_predicted"] - view["hit_rate_reported"], abs=2e-4)
    # aligned, the prediction is counted in the engine's own tokens: it tracks what was reported
    assert abs(aligned["hit_rate_gap"]) <= 0.05, aligned  # (the index keeps every 4th block: predictions round down)
    print("misaligned:", {k: mis[k] for k in ("hit_rate_reported", "hit_rate_predicted", "hit_rate_gap")})
    print("aligned:   ", {k: aligned[k] for k in ("hit_rate_reported", "hit_rate_predicted", "hit_rate_gap")})
