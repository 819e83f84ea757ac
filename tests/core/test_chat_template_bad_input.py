"""Bad input never raises while rendering or tokenizing: huge prompts, deep nesting, odd parts.

Every chat template (generic, Llama 3.1, Qwen2.5, Qwen3) and the whole pipeline under
``tokenizer: auto`` must key what it can and never fail a request.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.prefix.pipeline import PrefixPipeline
from gateway.prefix.settings import NormalizeSettings, PrefixSettings
from gateway.tokens.alignment import alignment_for_family

MODELS = {
    "generic": "some-unknown-model",
    "llama3.1": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen2.5": "Qwen/Qwen2.5-7B-Instruct",
    "qwen3": "Qwen/Qwen3-8B",
}


def nested(depth: int) -> list[Any]:
    value: list[Any] = [{"type": "text", "text": "deep"}]
    for _ in range(depth):
        value = [value]
    return value


def deep_dict(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"x": value}}
    return value


BAD_BODIES: list[tuple[str, list[Any], Any]] = [
    ("million chars", [{"role": "user", "content": "word " * 200_000}], None),
    ("one huge word", [{"role": "system", "content": "x" * 1_000_000}, {"role": "user", "content": "hi"}], None),
    ("nested content", [{"role": "user", "content": nested(5000)}], None),
    (
        "odd parts",
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}},
                    {"type": "text", "text": 42},
                    {"type": 7},
                    {"text": "no type"},
                    None,
                    3.5,
                    ["list", ["in", ["list"]]],
                    {"type": "image_url", "image_url": {"url": nested(50)}},
                ],
            }
        ],
        None,
    ),
    (
        "odd messages",
        [
            None,
            "a string",
            {"role": 5, "content": {"a": 1}},
            {"content": "no role"},
            {"role": "assistant", "content": None, "tool_calls": "nope"},
            {"role": "assistant", "tool_calls": [None, {"function": {"name": 3, "arguments": "{bad json"}}]},
            {"role": "tool", "content": None},
            {"role": "user", "content": "lone surrogate \ud800 and <|eot_id|><|im_start|> look-alikes"},
        ],
        None,
    ),
    (
        "deep tools",
        [{"role": "user", "content": "hi"}],
        [{"type": "function", "function": {"name": "f", "parameters": deep_dict(3000)}}],
    ),
    ("garbage tools", [{"role": "user", "content": "hi"}], [None, "x", {"function": "f"}, {"type": "function"}]),
    ("empty", [], None),
]


@pytest.mark.parametrize("family", ["llama3.1", "qwen2.5", "qwen3"])
@pytest.mark.parametrize("case", BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_templates_never_raise(family: str, case: tuple[str, list[Any], Any]) -> None:
    _, messages, tools = case
    template = alignment_for_family(family).template
    segments = list(template.segments(messages, tools))
    assert all(isinstance(s, str) for s in segments)


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("case", BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_pipeline_keys_what_it_can(family: str, case: tuple[str, list[Any], Any]) -> None:
    name, messages, tools = case
    pipeline = PrefixPipeline(NormalizeSettings(mode="report"), PrefixSettings(tokenizer="auto"))
    body: dict[str, Any] = {"model": MODELS[family], "messages": messages}
    if tools is not None:
        body["tools"] = tools
    prepared = pipeline.prepare("chat", body)
    assert prepared.units is not None
    if name in ("million chars", "one huge word"):
        assert prepared.window_tokens == 4096  # bounded work, full window
        assert len(prepared.block_keys) == 4096 // 16


def test_million_character_completion_prompt() -> None:
    pipeline = PrefixPipeline(NormalizeSettings(mode="off"), PrefixSettings(tokenizer="auto"))
    prepared = pipeline.prepare("completions", {"model": MODELS["llama3.1"], "prompt": "token " * 200_000})
    assert prepared.window_tokens == 4096
