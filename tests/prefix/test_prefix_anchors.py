"""Exact prompt lengths from replies anchor the token estimates past the window (gateway.prefix.anchors)."""

from __future__ import annotations

from typing import Any

from gateway.config import RouteConfig
from gateway.prefix.anchors import PromptAnchors
from gateway.prefix.pipeline import PrefixPipeline, PreparedPrompt
from gateway.prefix.settings import NormalizeSettings, PrefixSettings
from gateway.routing.routes import Route, request_view
from gateway.routing.runner import PolicyRunner
from tests.prefix.test_prefix_pipeline import words

WINDOW = 256


def pipeline(**prefix: Any) -> PrefixPipeline:
    return PrefixPipeline(NormalizeSettings(mode="off"), PrefixSettings(window_tokens=WINDOW, **prefix))


def route(p: PrefixPipeline) -> Route:
    """Only what ``Route.learn_prompt_tokens`` reads: the route's pipeline."""
    runner = PolicyRunner.__new__(PolicyRunner)
    return Route("main", RouteConfig(name="main"), runner, p, frozenset({"chat"}), "x-session-id")


def dense(n: int, seed: int) -> str:
    """Text at ~2 bytes per token (digits and punctuation), unlike the window's words (~4)."""
    return ",".join(str((seed * 7919 + i * 104729) % 100) for i in range(n))


def body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": messages}


def served(r: Route, prepared: PreparedPrompt, prompt_tokens: int) -> None:
    """The reply to ``prepared`` reported ``prompt_tokens`` (as Attempt.release passes it on)."""
    r.learn_prompt_tokens(request_view("main", "chat", {}, prepared), prompt_tokens)


def test_a_conversations_next_turn_counts_the_last_turns_prompt_exactly() -> None:
    p = pipeline()
    r = route(p)
    turn1 = [{"role": "system", "content": words(400, 1)}, {"role": "user", "content": dense(3000, 2)}]
    first = p.prepare("chat", body(turn1))
    assert first.text_keys and first.window_tokens == WINDOW
    measured = first.prompt_tokens_estimate + 700  # the dense text has more tokens than its bytes say
    served(r, first, measured)
    turn2 = [*turn1, {"role": "assistant", "content": "ok " * 50}, {"role": "user", "content": dense(500, 3)}]
    second = p.prepare("chat", body(turn2))
    at = len(first.keys) - 1 - len(second.block_keys)  # turn 1's last key, among turn 2's text keys
    assert second.keys[: len(first.keys)] == first.keys
    assert second.text_key_tokens[at] == measured  # exact where the reply measured it
    # the new text after it counts from there, at the window's ratio (as before the anchor)
    unanchored = pipeline().prepare("chat", body(turn2))
    assert unanchored.text_key_tokens[at] < measured - 600
    grown = second.text_key_tokens[-1] - second.text_key_tokens[at]
    assert grown == unanchored.text_key_tokens[-1] - unanchored.text_key_tokens[at]
    assert second.prompt_tokens_estimate == second.text_key_tokens[-1] > unanchored.prompt_tokens_estimate
    assert list(second.text_key_tokens) == sorted(second.text_key_tokens)


def test_a_shared_head_is_anchored_by_the_first_prompt_a_short_way_past_it() -> None:
    """New conversations fork at the head's end, which no prompt ends on: the first prompt
    behind it (one short user message) measures it, less that message's estimate."""
    p = pipeline()
    r = route(p)
    head = [{"role": "system", "content": words(300, 4) + dense(4000, 5)}]
    first = p.prepare("chat", body([*head, {"role": "user", "content": "Plan my week."}]))
    served(r, first, first.prompt_tokens_estimate + 1000)
    other = p.prepare("chat", body([*head, {"role": "user", "content": "Plan my trip to Oslo in May."}]))
    fork = next(i for i, (a, b) in enumerate(zip(first.keys, other.keys, strict=False)) if a != b)
    head_end = fork - 1 - len(other.block_keys)  # the head's last key, among the text keys
    tail = first.text_key_tokens[-1] - first.text_key_tokens[head_end] + 1000  # what the reply measured past it
    assert other.text_key_tokens[head_end] == first.prompt_tokens_estimate + 1000 - (tail - 1000)


def test_keys_inside_the_window_are_never_anchored() -> None:
    """Text keys whose chunk lies inside the tokenized window carry the window's count, not
    an estimate of their own: learning them would put a huge count on an early key."""
    anchors = PromptAnchors(100)
    keys, estimates = [1, 2, 3, 4], [256, 256, 300, 340]
    assert anchors.learn(keys, estimates, 400, 340, floor=256) == 2  # only keys 3 and 4
    tokens = [256, 256, 300, 340]
    assert anchors.estimate(keys, [1000, 2000, 3000, 4000], tokens, floor=256) == 400
    assert tokens == [256, 256, 360, 400]


def test_a_correction_is_interpolated_between_anchors_and_held_past_the_deepest() -> None:
    anchors = PromptAnchors(100)
    anchors.learn([10], [500], 600, 500, floor=100)  # +100 at key 10
    anchors.learn([30], [900], 1100, 900, floor=100)  # +200 at key 30
    keys = [5, 10, 20, 30, 40]
    tokens = [300, 500, 700, 900, 1100]
    ends = [1000, 2000, 3000, 4000, 5000]
    assert anchors.estimate(keys, ends, tokens, floor=100) == 1300
    # key 5: from no correction at the start to +100; key 20: halfway between; key 40: +200 held
    assert tokens == [350, 600, 850, 1100, 1300]


def test_an_exact_anchor_is_never_replaced_by_an_extrapolated_one() -> None:
    anchors = PromptAnchors(100)
    anchors.learn([1, 2], [400, 500], 520, 500, floor=100)  # key 2 exact: 520; key 1: 420, 100 back
    anchors.learn([1, 2, 3], [400, 500, 600], 700, 600, floor=100)  # key 2 now 100 back: kept at 520
    tokens = [400, 500, 600]
    anchors.estimate([1, 2, 3], [1000, 2000, 3000], tokens, floor=100)
    assert tokens[1] == 520 and tokens[2] == 700


def test_a_reply_far_from_the_estimate_teaches_nothing() -> None:
    """A truncated prompt, another tokenizer behind the same name, a bad usage object."""
    anchors = PromptAnchors(100)
    assert anchors.learn([1], [5000], 100, 5000, floor=256) == 0
    assert anchors.learn([1], [5000], 50_000, 5000, floor=256) == 0
    assert anchors.learn([1], [5000], 0, 5000, floor=256) == 0
    assert len(anchors) == 0


def test_anchors_are_bounded_and_can_be_turned_off() -> None:
    anchors = PromptAnchors(3)
    for key in range(10):
        anchors.learn([key], [1000], 1100, 1000, floor=256)
    assert len(anchors) == 3
    tokens = [1000]
    assert anchors.estimate([0], [4000], tokens, floor=256) is None and tokens == [1000]  # the oldest went first
    assert anchors.estimate([9], [4000], tokens, floor=256) == 1100
    off = pipeline(prompt_anchors=0)
    r = route(off)
    turn = [{"role": "system", "content": words(400, 1)}, {"role": "user", "content": dense(3000, 2)}]
    first = off.prepare("chat", body(turn))
    served(r, first, first.prompt_tokens_estimate + 700)
    assert len(off.anchors) == 0 and off.prepare("chat", body(turn)) == first


def test_a_reload_with_the_same_prefix_settings_keeps_what_was_learned() -> None:
    p = pipeline()
    r = route(p)
    turn = [{"role": "system", "content": words(400, 1)}, {"role": "user", "content": dense(3000, 2)}]
    served(r, p.prepare("chat", body(turn)), p.prepare("chat", body(turn)).prompt_tokens_estimate + 700)
    kept = p.reconfigured(NormalizeSettings(mode="report"), p.settings)
    assert kept.anchors is p.anchors and len(kept.anchors) > 0
    other = p.reconfigured(p.normalize_settings, PrefixSettings(window_tokens=512))
    assert len(other.anchors) == 0


class _Recorder:
    """A route that records what its attempt's release teaches it."""

    def __init__(self) -> None:
        self.learned: list[int] = []
        self.runner = self

    def release(self, *args: Any) -> None:
        pass

    def learn_prompt_tokens(self, request: Any, prompt_tokens: int | None) -> None:
        self.learned.append(prompt_tokens or 0)


def test_a_batch_of_prompts_teaches_nothing_its_usage_counts_them_all() -> None:
    from types import SimpleNamespace

    from gateway.config import HealthSettings, ReplicaConfig
    from gateway.replicas.pool import Replica
    from gateway.routing.attempt import Attempt

    def release(endpoint: str, body: dict[str, Any], completed: bool = True, served: bool = True) -> list[int]:
        route = _Recorder()
        plan = SimpleNamespace(
            route=route,
            endpoint=endpoint,
            prepared=SimpleNamespace(body=body),
            request=SimpleNamespace(prompt_tokens_estimate=0),
        )
        replica = Replica(ReplicaConfig(name="r0", url="http://h:1"), None, HealthSettings())  # type: ignore[arg-type]
        Attempt(plan, None, replica, charged=0).release(0, completed, served, 5000)  # type: ignore[arg-type]
        return route.learned

    assert release("completions", {"prompt": "one long prompt"}) == [5000]
    assert release("chat", {"messages": []}) == [5000]
    assert release("completions", {"prompt": ["first", "second"]}) == []
    assert release("completions", {"prompt": [[1, 2], [3, 4]]}) == []
    assert release("completions", {"prompt": [1, 2, 3]}) == [5000]  # one prompt of token ids
    assert release("chat", {"messages": []}, served=False) == []  # the replica did not serve it
    assert release("chat", {"messages": []}, completed=False) == []
