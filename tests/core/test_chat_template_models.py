"""The gateway's Llama 3.1/3.3 and Qwen2.5/Qwen3 renderers equal the published templates, byte for byte.

The reference is the model's own ``chat_template`` (tests/fixtures/chat_templates/, see its
README for where each came from) rendered the way transformers (and so vLLM) renders it:
jinja2's immutable sandbox with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols``
extension, transformers' ``tojson`` (no HTML escaping, keys in order) and ``raise_exception``.
Both sides get the messages as vLLM hands them to a template (string content, tool-call
arguments parsed from JSON): :func:`gateway.tokens.chat_template.vllm_messages`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest
import quicktok
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.tokens.alignment import alignment_for_family, family_for_model, resolve
from gateway.tokens.chat_template import SpecialToken, vllm_messages, vllm_tools
from gateway.tokens.tokenizer import get_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
SPECIAL_TOKENS = {
    "llama3.1": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "qwen2.5": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen3": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
}
FILES = {"llama3.1": "llama3.1_instruct.jinja", "qwen2.5": "qwen2.5_instruct.jinja", "qwen3": "qwen3.jinja"}


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def published(family: str, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool = True) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    template = env.from_string((FIXTURES / FILES[family]).read_text())
    return template.render(
        messages=vllm_messages(messages),
        tools=vllm_tools(tools),
        add_generation_prompt=add_generation_prompt,
        **SPECIAL_TOKENS[family],
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city — «quoted» ünïcode",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]


def conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "  You are a terse assistant.\nAnswer in English.  "},
        {"role": "user", "content": "Hello! What's 2+2?\n"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Zürich?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
        {"role": "assistant", "content": "It is 21 °C and clear in Zürich."},
        {"role": "user", "content": "日本語で言って。 <|im_start|> and <|eot_id|> are just text here"},
    ]


def qwen_conversation() -> list[dict[str, Any]]:
    """Two tool results in a row (merged into one user turn) and reasoning text."""
    msgs = conversation()[:-1]
    msgs[4]["tool_calls"].append({"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}})
    msgs.insert(6, {"role": "tool", "tool_call_id": "call_2", "content": "10:42"})
    msgs.append({"role": "user", "content": "Thanks"})
    msgs.append({"role": "assistant", "content": "<think>\nsmall talk\n</think>\n\nYou're welcome."})
    return msgs


CASES = [
    ("llama3.1", conversation),
    ("qwen2.5", conversation),
    ("qwen2.5", qwen_conversation),
    ("qwen3", conversation),
    ("qwen3", qwen_conversation),
]


@pytest.mark.parametrize("family,make", CASES)
@pytest.mark.parametrize("with_tools", [True, False])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_renderer_equals_published_template(family: str, make, with_tools: bool, generation_prompt: bool) -> None:
    messages = make()
    tools = TOOLS if with_tools else None
    template = alignment_for_family(family).template
    segments = list(template.segments(messages, tools, generation_prompt))
    assert "".join(segments) == published(family, messages, tools, generation_prompt)


@pytest.mark.parametrize("family", ["llama3.1", "qwen2.5", "qwen3"])
@pytest.mark.parametrize("n", range(1, 9))
def test_every_prefix_of_the_conversation_matches(family: str, n: int) -> None:
    messages = conversation()[:n]
    template = alignment_for_family(family).template
    assert "".join(template.segments(messages, None)) == published(family, messages, None)


@pytest.mark.parametrize("family", ["llama3.1", "qwen2.5", "qwen3"])
def test_special_token_text_in_content_is_parsed_as_vllm_does(family: str) -> None:
    """vLLM tokenizes the whole rendered string with every special token parsed, message content
    included (tiktoken's allowed_special="all"): the segments' ids must be exactly those."""
    alignment = alignment_for_family(family)
    tok = alignment.tokenizer
    messages = [m for m in conversation() if m["role"] in ("system", "user", "assistant") and not m.get("tool_calls")]
    segments = list(alignment.template.segments(messages, None))
    ids: list[int] = []
    for seg in segments:
        ids.extend([seg.id] if isinstance(seg, SpecialToken) else tok.encode(seg))
    vocab = "llama3" if family.startswith("llama") else "qwen3"
    engine = quicktok.get_encoding(vocab)
    rendered = "".join(segments)
    assert ids == engine.encode(rendered, allowed_special="all")
    # the user's look-alikes (the last user message) are single special ids, not text
    cut = rendered.index("日本語")
    tail = engine.encode(rendered[cut:], allowed_special="all")
    for marker in ("<|im_start|>", "<|eot_id|>"):
        if marker in engine.special_tokens_set:
            assert engine.encode_single_token(marker) in tail
    assert sum(1 for seg in segments if isinstance(seg, SpecialToken) and "日本語" not in seg) >= 2


def test_rendered_prefix_is_stable_across_turns() -> None:
    """Turn N+1's segments start with turn N's (without the generation prompt): block keys extend."""
    for family in ("llama3.1", "qwen2.5", "qwen3"):
        template = alignment_for_family(family).template
        msgs = conversation()
        for n in range(2, len(msgs)):
            before = "".join(template.segments(msgs[:n], TOOLS, add_generation_prompt=False))
            after = "".join(template.segments(msgs[: n + 1], TOOLS))
            if family == "qwen3" and msgs[n - 1]["role"] == "assistant":
                continue  # Qwen3 re-renders the last assistant turn's reasoning
            assert after.startswith(before), (family, n)


@pytest.mark.parametrize(
    "model,vocab",
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "llama3"),
        ("meta-llama/Llama-3.3-70B-Instruct", "llama3"),
        ("Qwen/Qwen3-8B", "qwen3"),
        ("Qwen/Qwen2.5-7B-Instruct", "qwen3"),
        ("acme/totally-unknown-model-13b", "cl100k_base"),
        ("gpt-4o-mini", "o200k_base"),
    ],
)
def test_auto_picks_the_vocabulary_from_real_model_names(model: str, vocab: str) -> None:
    alignment = resolve("auto", model)
    assert alignment.tokenizer.name == vocab
    assert alignment.tokenizer is get_tokenizer(vocab)
    exact = vocab in ("llama3", "qwen3")
    assert alignment.exact is exact
    assert alignment.units == f"{'exact' if exact else 'approximate'} ({vocab})"


def test_family_names() -> None:
    assert family_for_model("meta-llama/Llama-3.1-8B-Instruct") == "llama3.1"
    assert family_for_model("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5"
    assert family_for_model("Qwen/Qwen3-8B") == "qwen3"
    assert family_for_model("meta-llama/Meta-Llama-3-8B-Instruct") == "llama3"  # 3.0: approximate
    assert family_for_model("mistralai/Mistral-7B-Instruct-v0.3") == "cl100k_base"


def test_completions_get_llamas_bos_like_vllm() -> None:
    from gateway.tokens.window import ModelWindows

    windows = ModelWindows("auto", 4096, 0)
    llama = list(windows.for_model("meta-llama/Llama-3.1-8B-Instruct").text("The capital of France is"))
    assert llama[0] == 128000 and llama[1:] == get_tokenizer("llama3").encode("The capital of France is")
    qwen = list(windows.for_model("Qwen/Qwen3-8B").text("The capital of France is"))
    assert qwen == get_tokenizer("qwen3").encode("The capital of France is")
