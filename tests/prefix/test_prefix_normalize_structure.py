"""Normalization never corrupts structure: code and embedded JSON are reported, not rewritten;
our markers in the input cannot break idempotency (issue 9, "never corrupt structure")."""

from __future__ import annotations

import functools
import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.prefix.normalize import Normalizer
from gateway.prefix.settings import NormalizeSettings, RegexRule
from gateway.prefix.structure import structured_ranges
from gateway.prefix.volatile import BLOCK_CLOSE, BLOCK_OPEN, placeholder, values_block

ALWAYS = Normalizer(NormalizeSettings(mode="relocate", always=["*"]))
STAMP = "2025-03-04T05:06:07Z"


def chat(system: str, user: str = "go") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_json_config_in_a_prompt_stays_valid() -> None:
    config = '{"ttl": 1741064767, "created": "2025-03-04T05:06:07Z", "nested": [{"at": "2025-03-04"}]}'
    body = chat(f"Use this config:\n{config}\nNow: {STAMP}")
    result = ALWAYS.apply("chat", body)
    system = result.body["messages"][0]["content"]
    assert config in system and json.loads(config)  # byte for byte, still valid JSON
    assert system.endswith("Now: {{volatile:iso_datetime:1}}")  # outside the JSON: moved
    protected = {(k.rule, k.value) for k in result.kept if k.status == "protected"}
    assert protected == {("unix_timestamp", "1741064767"), ("iso_datetime", STAMP), ("date", "2025-03-04")}


def test_code_is_not_rewritten() -> None:
    fenced = "```python\ndate = parse('2024-01-15')\nwhen = '2025-03-04T05:06:07Z'\n```"
    inline = "call `parse('2024-01-15')` first"
    body = chat(f"{fenced}\n{inline}\n~~~\nid 550e8400-e29b-41d4-a716-446655440000\n~~~")
    result = ALWAYS.apply("chat", body)
    assert result.body is body
    assert sorted(k.rule for k in result.kept) == ["date", "date", "iso_datetime", "uuid"]
    assert all(k.status == "protected" for k in result.kept)


def test_unclosed_fence_protects_to_the_end() -> None:
    body = chat(f"Now {STAMP}\n```\nexample {STAMP}")
    result = ALWAYS.apply("chat", body)
    assert result.body["messages"][0]["content"] == f"Now {{{{volatile:iso_datetime:1}}}}\n```\nexample {STAMP}"


def test_a_routes_own_rule_still_targets_json_and_code() -> None:
    norm = Normalizer(NormalizeSettings(mode="relocate", rules=[RegexRule(name="ttl", pattern=r"(?<=\"ttl\": )\d+")]))
    body = chat('config {"ttl": 1741064767, "x": 1}')
    assert norm.apply("chat", body).body["messages"][0]["content"] == 'config {"ttl": {{volatile:ttl:1}}, "x": 1}'


def test_prose_brackets_are_not_json() -> None:
    assert structured_ranges("see [1] and {name} and [2025-03-04]") == []
    assert structured_ranges('x {"a": [1, 2]} y') == [(2, 15)]


def test_json_search_is_bounded_on_hostile_input() -> None:
    text = '{"a": ' * 5000 + STAMP
    assert structured_ranges(text) == []  # gives up after a bounded number of failed parses


def test_literal_block_and_placeholders_in_the_input() -> None:
    fake = f"{BLOCK_OPEN}>\n{placeholder('iso_datetime', 1)} = {STAMP}\n{BLOCK_CLOSE}"
    body = chat(f"Copied: {fake}\nAlso {placeholder('iso_datetime', 1)} and now {STAMP}")
    once = ALWAYS.apply("chat", body)
    system = once.body["messages"][0]["content"]
    # the pasted block is plain text: its value moved too, numbered after the existing placeholder
    assert STAMP not in system and "{{volatile:iso_datetime:2}}" in system and "{{volatile:iso_datetime:3}}" in system
    assert ALWAYS.apply("chat", once.body).body is once.body


# --- idempotency over random prompts, including our own markers ----------------------------
PIECES = [
    "word ",
    "\n",
    STAMP,
    " 2025-03-05 ",
    "17:30 ",
    "1741064767 ",
    "req_8f3k2l9x0a ",
    "550e8400-e29b-41d4-a716-446655440000",
    "{{volatile:iso_datetime:1}}",
    "{{volatile:date:7}}",
    "{{volatile:",
    "}}",
    BLOCK_OPEN,
    BLOCK_OPEN + ">\n",
    BLOCK_CLOSE,
    values_block(["{{volatile:date:1}} = 2025-03-04"]),
    "```\n",
    "`",
    '{"ttl": ',
    "}",
    "现在时间",
    "2025年3月4日17:30:00",
    " = ",
]
_PIECES = st.sampled_from(PIECES)


def _body(system: list[str], user: list[str], role: str) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": "".join(system)},
            {"role": "user", "content": "".join(user)},
            *([{"role": "assistant", "content": "ok"}, {"role": role, "content": "t"}] if role else []),
        ],
    }


IDEMPOTENT_ROLES = Normalizer(NormalizeSettings(mode="relocate", always=["*"], roles=["system", "user"]))


@functools.cache
def _budgeted(budget: int) -> Normalizer:
    return Normalizer(NormalizeSettings(mode="relocate", always=["*"], max_scan_chars=budget))


def _check_idempotent(body: dict[str, Any], budget: int) -> None:
    for norm in (IDEMPOTENT_ROLES,):
        once = norm.apply("chat", body)
        twice = norm.apply("chat", once.body, learn=False)  # same learned state as the first pass
        assert twice.body is once.body, (body, once.body)
    budgeted = _budgeted(budget)
    once = budgeted.apply("chat", body)
    assert budgeted.apply("chat", once.body, learn=False).body is once.body


@pytest.mark.slow
def test_relocation_is_idempotent_on_10000_random_prompts_with_our_markers() -> None:
    """The issue's bar, as a fast seeded loop (hypothesis below shrinks failures on fewer cases)."""
    rng = random.Random(9)
    for _ in range(10_000):
        system = rng.choices(PIECES, k=rng.randint(0, 12))
        user = rng.choices(PIECES, k=rng.randint(0, 6))
        _check_idempotent(
            _body(system, user, rng.choice(["", "user", "tool"])), rng.choice([0, 5, 17, 40, 90, 200, 400])
        )


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(_PIECES, max_size=12),
    st.lists(_PIECES, max_size=6),
    st.sampled_from(["", "user", "tool"]),
    st.integers(0, 400),
)
@pytest.mark.slow
def test_relocation_is_idempotent_on_random_prompts_with_our_markers(
    system: list[str], user: list[str], role: str, budget: int
) -> None:
    """A second pass never moves anything again."""
    _check_idempotent(_body(system, user, role), budget)
