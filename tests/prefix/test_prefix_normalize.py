"""Normalization: modes, relocation and its guarantees (every value kept, idempotent, minimal)."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.prefix.normalize import Normalizer
from gateway.prefix.settings import NormalizeSettings, RegexRule
from gateway.prefix.volatile import BLOCK_CLOSE, BLOCK_OPEN, PLACEHOLDER_RE
from gateway.tokens.chat_template import chat_tokens
from gateway.tokens.tokenizer import get_tokenizer

# "always": move on first sight (the learner of what varies has its own tests below).
RELOCATE = Normalizer(NormalizeSettings(mode="relocate", always=["*"]))
REPORT = Normalizer(NormalizeSettings(mode="report"))
OFF = Normalizer(NormalizeSettings(mode="off"))

STAMP = "2025-03-04T05:06:07Z"
SESSION = "550e8400-e29b-41d4-a716-446655440000"


def chat(system: str, user: Any = "What is new?", **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        **extra,
    }


def block_values(text: str) -> dict[str, str]:
    """placeholder -> value pairs of every values block in ``text``."""
    out = {}
    for body in re.findall(
        re.escape(BLOCK_OPEN) + r' check="[0-9a-f]{8}">\n(.*?)\n' + re.escape(BLOCK_CLOSE), text, re.S
    ):
        for line in body.splitlines():
            m = re.match(r"(\{\{volatile:[a-z0-9_]+:\d+\}\}) = (.*)$", line)
            if m:
                out[m.group(1)] = m.group(2)
    return out


def restore(text: str, values: dict[str, str]) -> str:
    return PLACEHOLDER_RE.sub(lambda m: values[m.group(0)], text)


# --- modes ----------------------------------------------------------------------------------
def test_off_mode_does_nothing() -> None:
    body = chat(f"Now: {STAMP}")
    result = OFF.apply("chat", body)
    assert result.body is body and result.counts == {} and not result.relocated


def test_report_mode_counts_and_changes_nothing() -> None:
    body = chat(f"Now: {STAMP}. Session {SESSION}.")
    snapshot = copy.deepcopy(body)
    result = REPORT.apply("chat", body)
    assert result.body is body and body == snapshot
    assert result.counts == {"iso_datetime": 1, "uuid": 1}
    assert not result.relocated and result.changes == ()


def test_relocate_moves_values_to_last_user_message() -> None:
    body = chat(f"Now: {STAMP}. Session {SESSION}.", "Hi")
    snapshot = copy.deepcopy(body)
    result = RELOCATE.apply("chat", body)
    assert body == snapshot, "the input body is never mutated"
    system, user = result.body["messages"]
    assert system["content"] == "Now: {{volatile:iso_datetime:1}}. Session {{volatile:uuid:1}}."
    assert user["content"].startswith("Hi\n\n" + BLOCK_OPEN)
    assert block_values(user["content"]) == {"{{volatile:iso_datetime:1}}": STAMP, "{{volatile:uuid:1}}": SESSION}
    assert result.counts == {"iso_datetime": 1, "uuid": 1} and result.relocated
    assert [(c.where, c.rule, c.value) for c in result.changes] == [
        ("messages[0].content", "iso_datetime", STAMP),
        ("messages[0].content", "uuid", SESSION),
    ]


def test_no_volatile_spans_returns_the_same_object() -> None:
    body = chat("You are a helpful assistant.", "Tell me about 2025-03-04.")  # user text is out of scope
    assert RELOCATE.apply("chat", body).body is body


def test_relocation_with_list_content() -> None:
    system = [{"type": "text", "text": f"Time {STAMP}."}, {"type": "text", "text": "Be brief."}]
    user = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    body = chat(system, user)  # type: ignore[arg-type]
    result = RELOCATE.apply("chat", body)
    new_system, new_user = result.body["messages"]
    assert new_system["content"][0]["text"] == "Time {{volatile:iso_datetime:1}}."
    assert new_system["content"][1] is system[1], "untouched parts are shared, not copied"
    assert new_user["content"][:2] == user
    assert new_user["content"][2]["type"] == "text"
    assert block_values(new_user["content"][2]["text"]) == {"{{volatile:iso_datetime:1}}": STAMP}


def test_assistant_and_tool_messages_are_never_touched() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": f"Now {STAMP}"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": f"It is {STAMP}", "tool_calls": [{"id": "c1"}]},
            {"role": "tool", "tool_call_id": "c1", "content": f"result at {STAMP} {SESSION}"},
            {"role": "user", "content": "and now?"},
        ],
    }
    result = RELOCATE.apply("chat", body)
    for i in (2, 3):
        assert result.body["messages"][i] is body["messages"][i]
    assert result.counts == {"iso_datetime": 1}
    assert BLOCK_OPEN in result.body["messages"][4]["content"]
    assert result.body["messages"][1] is body["messages"][1]


def test_roles_must_not_include_assistant_or_tool() -> None:
    with pytest.raises(ValueError):
        NormalizeSettings(roles=["assistant"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        NormalizeSettings(roles=["tool"])  # type: ignore[list-item]


def test_developer_role_is_in_scope_by_default_and_user_only_when_configured() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "developer", "content": f"at {STAMP}"}, {"role": "user", "content": f"at {STAMP}"}],
    }
    assert RELOCATE.apply("chat", body).counts == {"iso_datetime": 1}
    with_user = Normalizer(NormalizeSettings(mode="relocate", always=["*"], roles=["developer", "user"]))
    result = with_user.apply("chat", body)
    assert result.counts == {"iso_datetime": 2}
    user = result.body["messages"][1]["content"]
    assert user.startswith("at {{volatile:iso_datetime:2}}\n\n" + BLOCK_OPEN)
    assert with_user.apply("chat", result.body).body is result.body


# --- tools ----------------------------------------------------------------------------------
def weather_tool(description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": "getWeatherV2Async",
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": f"City; data as of {STAMP}"}},
                "required": ["city"],
            },
        },
    }


def test_tool_descriptions_are_relocated_and_names_kept() -> None:
    tools = [weather_tool(f"Weather, updated {STAMP}"), {"type": "function", "function": {"name": "noop"}}]
    body = chat("Plain system prompt.", "Weather in Paris?", tools=tools)
    result = RELOCATE.apply("chat", body)
    new_tools = result.body["tools"]
    fn = new_tools[0]["function"]
    assert fn["name"] == "getWeatherV2Async"
    assert fn["description"] == "Weather, updated {{volatile:iso_datetime:1}}"
    assert fn["parameters"]["properties"]["city"]["description"] == "City; data as of {{volatile:iso_datetime:2}}"
    assert new_tools[1] is tools[1]
    assert fn["parameters"]["required"] is tools[0]["function"]["parameters"]["required"]
    assert block_values(result.body["messages"][1]["content"]) == {
        "{{volatile:iso_datetime:1}}": STAMP,
        "{{volatile:iso_datetime:2}}": STAMP,
    }
    assert [c.where for c in result.changes] == [
        "tools[0].function.description",
        "tools[0].function.parameters.properties.city.description",
    ]


def test_tools_scope_can_be_disabled() -> None:
    body = chat("Plain.", tools=[weather_tool(f"at {STAMP}")])
    assert Normalizer(NormalizeSettings(mode="relocate", always=["*"], tools=False)).apply("chat", body).body is body


def test_canonicalize_tools_sorts_keys_and_is_idempotent() -> None:
    tool = {"type": "function", "function": {"parameters": {"type": "object", "properties": {}}, "name": "f"}}
    norm = Normalizer(NormalizeSettings(mode="report", canonicalize_tools=True))
    body = chat("x", tools=[tool])
    result = norm.apply("chat", body)
    assert result.canonicalized and result.rewritten and not result.relocated
    dumped = json.dumps(result.body["tools"])
    assert dumped == json.dumps([tool], sort_keys=True)
    again = norm.apply("chat", result.body)
    assert again.body is result.body and not again.canonicalized
    # Two key orders of the same schema become the same bytes.
    other = {"function": {"name": "f", "parameters": {"properties": {}, "type": "object"}}, "type": "function"}
    assert json.dumps(norm.apply("chat", chat("x", tools=[other])).body["tools"]) == dumped


# --- placements -----------------------------------------------------------------------------
@pytest.mark.parametrize("placement", ["system_before_last_user", "trailing_system"])
def test_other_placements(placement: str) -> None:
    norm = Normalizer(NormalizeSettings(mode="relocate", always=["*"], placement=placement))  # type: ignore[arg-type]
    body = chat(f"Now {STAMP}", "Hi")
    result = norm.apply("chat", body)
    messages = result.body["messages"]
    assert len(messages) == 3
    block_at = 1 if placement == "system_before_last_user" else 2
    assert messages[block_at]["role"] == "system"
    assert block_values(messages[block_at]["content"]) == {"{{volatile:iso_datetime:1}}": STAMP}
    assert messages[3 - block_at]["content"] == "Hi"
    assert norm.apply("chat", result.body).body is result.body


def test_last_user_placement_without_user_message_falls_back_to_trailing_system() -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": f"Now {STAMP}"}]}
    norm = Normalizer(NormalizeSettings(mode="relocate", always=["*"], placement="last_user"))
    messages = norm.apply("chat", body).body["messages"]
    assert [m["role"] for m in messages] == ["system", "system"]
    assert BLOCK_OPEN in messages[1]["content"]


# --- completions ----------------------------------------------------------------------------
def test_completion_prompt_block_goes_after_the_span_line() -> None:
    body = {"model": "m", "prompt": f"Date: {STAMP}\nYou are a bot.\nQ: hi\nA:"}
    norm = Normalizer(NormalizeSettings(mode="relocate", always=["*"], completion_placement="after_span_line"))
    result = norm.apply("completions", body)
    prompt = result.body["prompt"]
    assert prompt.startswith("Date: {{volatile:iso_datetime:1}}\n" + BLOCK_OPEN)
    assert prompt.endswith(BLOCK_CLOSE + "\nYou are a bot.\nQ: hi\nA:")
    assert block_values(prompt) == {"{{volatile:iso_datetime:1}}": STAMP}
    assert norm.apply("completions", result.body).body is result.body


def test_completion_prompt_end_placement_and_prefix_limit() -> None:
    norm = Normalizer(
        NormalizeSettings(mode="relocate", always=["*"], completion_placement="end", completion_prefix_chars=40)
    )
    prompt = f"Now {STAMP} and later" + " filler" * 10 + f" {SESSION}"
    result = norm.apply("completions", {"model": "m", "prompt": prompt})
    new = result.body["prompt"]
    assert result.counts == {"iso_datetime": 1}, "the uuid lies past completion_prefix_chars"
    assert SESSION in new.split(BLOCK_OPEN)[0]
    assert new.endswith(BLOCK_CLOSE)
    assert norm.apply("completions", result.body).body is result.body


def test_completion_batch_and_token_prompts() -> None:
    body = {"model": "m", "prompt": [f"At {STAMP}", "no spans"]}
    result = RELOCATE.apply("completions", body)
    assert result.body["prompt"][1] is body["prompt"][1]
    assert result.body["prompt"][0].startswith("At {{volatile:iso_datetime:1}}")
    ids = {"model": "m", "prompt": [1, 2, 3]}
    assert RELOCATE.apply("completions", ids).body is ids
    assert REPORT.apply("completions", {"model": "m", "prompt": f"At {STAMP}"}).counts == {"iso_datetime": 1}


def test_custom_rules_relocate() -> None:
    norm = Normalizer(
        NormalizeSettings(
            mode="relocate", always=["*"], detectors=[], rules=[RegexRule(name="order", pattern=r"ORD-\d+")]
        )
    )
    result = norm.apply("chat", chat("Order ORD-991 at 2025-03-04", "status?"))
    assert result.body["messages"][0]["content"] == "Order {{volatile:order:1}} at 2025-03-04"
    assert result.counts == {"order": 1}


def test_scan_budget() -> None:
    norm = Normalizer(NormalizeSettings(mode="relocate", always=["*"], max_scan_chars=30))
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": f"A {STAMP}" + " x" * 20},
            {"role": "system", "content": f"B {STAMP}"},
            {"role": "user", "content": "q"},
        ],
    }
    result = norm.apply("chat", body)
    assert result.counts == {"iso_datetime": 1}
    assert result.body["messages"][1] is body["messages"][1]


# --- properties -----------------------------------------------------------------------------
VALUES = {
    "iso_datetime": st.builds(
        lambda y, mo, d, h, mi, s: f"{y}-{mo:02d}-{d:02d}T{h:02d}:{mi:02d}:{s:02d}Z",
        st.integers(2000, 2099),
        st.integers(1, 12),
        st.integers(1, 28),
        st.integers(0, 23),
        st.integers(0, 59),
        st.integers(0, 59),
    ),
    "uuid": st.uuids().map(str),
    "unix_timestamp": st.integers(1_700_000_001, 1_799_999_999).map(str).filter(lambda v: not v.endswith("000")),
    "hex_id": st.binary(min_size=16, max_size=32).map(lambda b: b.hex()).filter(lambda h: any(c.isdigit() for c in h)),
}
TEMPLATES = [
    "You are Ava. The current time is {iso_datetime}. Be concise.",
    "Session {uuid} started at {unix_timestamp}.\nRules: be kind.",
    "Trace {hex_id}; now {iso_datetime}; request {uuid}.",
    "No volatile values here at all, just words.",
]


@st.composite
def volatile_chat(draw: st.DrawFn, template: str | None = None) -> tuple[str, dict[str, Any]]:
    template = template or draw(st.sampled_from(TEMPLATES))
    values = {name: draw(strategy) for name, strategy in VALUES.items()}
    user = draw(st.text(alphabet="abc xyz?", min_size=1, max_size=30))
    history = draw(st.booleans())
    messages = [{"role": "system", "content": template.format(**values)}]
    if history:
        messages += [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": f"ok {values['uuid']}"}]
    messages.append({"role": "user", "content": user})
    return template, {"model": "m", "messages": messages}


@settings(max_examples=80, deadline=None)
@given(volatile_chat())
def test_relocation_keeps_every_value(case: tuple[str, dict[str, Any]]) -> None:
    _, body = case
    result = RELOCATE.apply("chat", body)
    messages = result.body["messages"]
    values = block_values(messages[-1]["content"])
    assert restore(messages[0]["content"], values) == body["messages"][0]["content"]
    assert messages[-1]["content"].split("\n\n" + BLOCK_OPEN)[0] == body["messages"][-1]["content"]
    assert len(values) == sum(result.counts.values()) == len(result.changes)


@settings(max_examples=80, deadline=None)
@given(volatile_chat())
def test_relocation_is_idempotent(case: tuple[str, dict[str, Any]]) -> None:
    _, body = case
    once = RELOCATE.apply("chat", body)
    twice = RELOCATE.apply("chat", once.body)
    assert twice.body is once.body
    assert twice.counts == {}


@settings(max_examples=60, deadline=None)
@given(st.data())
@pytest.mark.slow
def test_stable_prefix_is_identical_across_volatile_values(data: st.DataObject) -> None:
    template = data.draw(st.sampled_from(TEMPLATES))
    _, a = data.draw(volatile_chat(template))
    _, b = data.draw(volatile_chat(template))
    ra, rb = RELOCATE.apply("chat", a), RELOCATE.apply("chat", b)
    assert ra.body["messages"][0] == rb.body["messages"][0]
    # ... so the token prefix up to the relocated block agrees too.
    tok = get_tokenizer()
    ta = chat_tokens(tok, ra.body["messages"][:1], add_generation_prompt=False)
    tb = chat_tokens(tok, rb.body["messages"][:1], add_generation_prompt=False)
    assert ta == tb


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="abcdefghij klmn.,;:!?()\n", max_size=300))
def test_text_without_volatile_spans_is_byte_identical(text: str) -> None:
    body = chat(text or "x", text or "y")
    assert RELOCATE.apply("chat", body).body is body
    completion = {"model": "m", "prompt": text}
    assert RELOCATE.apply("completions", completion).body is completion


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(["word", STAMP, SESSION, "1717171717", "x" * 30, "\n"]), min_size=1, max_size=40),
    st.integers(0, 400),
)
def test_idempotent_under_any_scan_budget(parts: list[str], budget: int) -> None:
    norm = Normalizer(
        NormalizeSettings(mode="relocate", always=["*"], max_scan_chars=budget, completion_prefix_chars=budget)
    )
    text = " ".join(parts)
    body = {"model": "m", "messages": [{"role": "system", "content": text}, {"role": "user", "content": "q"}]}
    once = norm.apply("chat", body)
    assert norm.apply("chat", once.body).body is once.body
    prompt = {"model": "m", "prompt": text}
    once_p = norm.apply("completions", prompt)
    assert norm.apply("completions", once_p.body).body is once_p.body
