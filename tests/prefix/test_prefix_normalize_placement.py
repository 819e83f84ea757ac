"""Placement keeps multi-turn conversations and agent tool loops cached (issue 9, item 3)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.prefix.normalize import Normalizer
from gateway.prefix.settings import NormalizeSettings
from gateway.prefix.volatile import BLOCK_OPEN
from gateway.tokens.chat_template import chat_tokens
from gateway.tokens.tokenizer import get_tokenizer

SYSTEM = "You are an agent that uses tools carefully. " * 220  # ~2,000 tokens, a typical agent prompt
TOOL_RESULT = "Result rows: " + "alpha beta gamma delta " * 20


def norm(placement: str = "end") -> Normalizer:
    return Normalizer(NormalizeSettings(mode="relocate", always=["*"], placement=placement))  # type: ignore[arg-type]


def loop_step(k: int, stamp: str) -> list[dict[str, Any]]:
    """Step k of a tool loop: fresh timestamp on top, one task, then k tool call/result pairs."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"Current time: {stamp}. Trace 4bf92f3577b34da6a3ce929d0e0e4736.\n{SYSTEM}"},
        {"role": "user", "content": "Find the three largest customers and summarize their orders."},
    ]
    for i in range(k):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "query", "arguments": f'{{"page": {i}}}'}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"{TOOL_RESULT} page {i}"})
    return messages


def shared_blocks(a: list[int], b: list[int], block: int = 16) -> tuple[int, int]:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n // block, len(b) // block


def test_end_appends_to_the_last_tool_message() -> None:
    body = {"model": "m", "messages": loop_step(2, "2025-03-04T05:06:07Z")}
    out = norm().apply("chat", body).body["messages"]
    assert out[-1]["role"] == "tool" and BLOCK_OPEN in out[-1]["content"]
    assert out[-1]["content"].startswith(TOOL_RESULT)
    assert out[1] is body["messages"][1] and out[2] is body["messages"][2]  # history untouched


def test_end_falls_back_to_a_trailing_system_message_after_an_assistant() -> None:
    messages = [*loop_step(0, "2025-03-04T05:06:07Z"), {"role": "assistant", "content": "Sure, "}]
    out = norm().apply("chat", {"model": "m", "messages": messages}).body["messages"]
    assert [m["role"] for m in out][-2:] == ["assistant", "system"] and BLOCK_OPEN in out[-1]["content"]


@pytest.mark.parametrize(
    ("placement", "minimum"),
    [("end", 0.95), ("trailing_system", 0.95), ("last_user", 0.0), ("system_before_last_user", 0.0)],
)
def test_tool_loop_reuse_per_placement(placement: str, minimum: float) -> None:
    """Step k+1 shares >= 95 % of step k's blocks with ``end`` (the old default shared ~3 %)."""
    tok = get_tokenizer()
    n = norm(placement)
    prev: list[int] | None = None
    ratios = []
    for k in range(1, 8):
        body = {"model": "m", "messages": loop_step(k, f"2025-03-04T05:06:{k:02d}Z")}
        tokens = chat_tokens(tok, n.apply("chat", body).body["messages"], add_generation_prompt=True)
        if prev is not None:
            shared, total = shared_blocks(tokens, prev)
            ratios.append(shared / total)
        prev = tokens
    if minimum:
        assert min(ratios[1:]) >= minimum, ratios  # from step 3 on
    else:  # the block after the task splits every later step: reuse falls as the loop grows
        assert ratios[-1] < 0.75 and ratios == sorted(ratios, reverse=True), ratios
