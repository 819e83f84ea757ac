"""The lane's mixed workload: what the recorder sends and the real-engine tests replay.

Deterministic text (seeded word salad, no external data) shaped like real traffic: several
conversations with 1-4k-token system prompts and growing histories, one pasting a document that
contains special-token text (``<|eot_id|>``, header markers) as plain content, one with tools and a
tool call, and completions prompts that extend a shared document; streaming and not.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_WORD_TEXT = (
    "cache prefix block token engine replica router request stream usage model kernel batch queue "
    "latency tenant session shard policy affinity window vector matrix memory device scheduler prompt "
    "reply document chapter section paragraph clause invoice ledger account balance river mountain "
    "forest city harbour market garden library station bridge tower engine signal network packet"
)
_WORDS = _WORD_TEXT.split()

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by its id.",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
        },
    },
]

SPECIAL_TEXT_DOC = (
    "Here is a transcript I exported, markers included:\n"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nParis.<|eot_id|>\n"
    "Please explain why the markers <|eot_id|> and <|begin_of_text|> appear here."
)


def text(n_words: int, seed: int) -> str:
    """About 1.3 tokens per word with Llama 3's vocabulary; sentences so BPE sees punctuation."""
    rng = random.Random(seed)
    out, sentence = [], []
    for _ in range(n_words):
        sentence.append(rng.choice(_WORDS))
        if len(sentence) >= rng.randint(6, 14):
            out.append(" ".join(sentence).capitalize() + rng.choice(".;?!") + " ")
            sentence = []
    return "".join(out) + " ".join(sentence)


@dataclass
class Conversation:
    """A chat whose next request carries every earlier turn, the engine's own replies included."""

    name: str
    system: str
    users: list[str]
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": self.system}]

    def turns(self) -> Iterator[dict[str, Any]]:
        """Request bodies, one per user turn; call :meth:`answer` with each reply in between."""
        for i, user in enumerate(self.users):
            self.messages.append({"role": "user", "content": user})
            body: dict[str, Any] = {
                "model": MODEL,
                "messages": [dict(m) for m in self.messages],
                "max_tokens": 8,
                "temperature": 0,
                "seed": 7,
            }
            if self.tools is not None:
                body["tools"] = self.tools
            if self.stream and i % 2 == 1:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
            yield body

    def answer(self, content: str) -> None:
        self.messages.append({"role": "assistant", "content": content})


def tool_call_turns() -> list[dict[str, Any]]:
    """A conversation where the assistant called a tool and the tool answered (as clients send it)."""
    system = "You are a helpful assistant with tools. " + text(900, 40)
    base = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is the weather in Paris, in celsius?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    first = {"model": MODEL, "messages": base, "tools": TOOLS, "max_tokens": 8, "temperature": 0, "seed": 7}
    second = dict(first, messages=[*base, {"role": "user", "content": "And in Lyon? " + text(40, 41)}])
    return [first, dict(second, stream=True, stream_options={"include_usage": True})]


def conversations(scale: int = 1) -> list[Conversation]:
    """Conversations with 1-4k-token system prompts (``scale`` repeats the set with new seeds)."""
    out = []
    for s in range(scale):
        k = 100 * s
        out += [
            Conversation(f"support-{s}", text(800, 1 + k), [text(60, 2 + k), text(30, 3 + k), text(90, 4 + k)]),
            Conversation(
                f"legal-{s}", text(2300, 5 + k), [text(120, 6 + k), text(20, 7 + k), text(50, 8 + k)], stream=True
            ),
            Conversation(f"special-{s}", text(1200, 9 + k), [SPECIAL_TEXT_DOC, text(40, 10 + k), text(25, 11 + k)]),
            Conversation(
                f"tools-{s}", text(1500, 12 + k), [text(30, 13 + k), text(45, 14 + k)], tools=TOOLS, stream=True
            ),
            # the third turn passes 4,096 tokens: the default route's exact token window
            Conversation(f"long-{s}", text(3000, 15 + k), [text(200, 16 + k), text(35, 17 + k), text(700, 18 + k)]),
        ]
    return out


def completions(scale: int = 1) -> list[dict[str, Any]]:
    """Completions prompts that share a long document and differ in the question (some streamed)."""
    out = []
    for s in range(scale):
        doc = text(1800, 30 + 100 * s)
        for i in range(4):
            body: dict[str, Any] = {
                "model": MODEL,
                "prompt": doc + "\n\nQuestion: " + text(25, 31 + 100 * s + i) + "\nAnswer:",
                "max_tokens": 8,
                "temperature": 0,
                "seed": 7,
            }
            if i % 2:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
            out.append(body)
    return out


ERROR_CASES: list[tuple[str, str, dict[str, Any]]] = [
    (
        "err-temperature",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
    ),
    (
        "err-max-tokens",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9000},
    ),
    (
        "err-max-tokens-completions",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 9000},
    ),
    (
        "over-context-clamped",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": text(7000, 50)}], "max_tokens": 2000},
    ),
    (
        "err-prompt-too-long",
        "/v1/completions",
        {"model": MODEL, "prompt": text(7600, 51), "max_tokens": 8},
    ),
    (
        "err-lora-not-served",
        "/v1/chat/completions",
        {"model": "my-lora-adapter", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    ),
    (
        "unknown-fields",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "frobnicate": True,
            "x_extra": {"a": 1},
        },
    ),
    (
        "err-bad-type",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"},
    ),
    (
        "err-no-messages",
        "/v1/chat/completions",
        {"model": MODEL, "max_tokens": 4},
    ),
    (
        "err-n-top-logprobs",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 2},
    ),
    (
        "cache-salt",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": text(300, 52)}], "max_tokens": 4, "cache_salt": "t1"},
    ),
    (
        "cache-salt-again",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": text(300, 52)}], "max_tokens": 4, "cache_salt": "t1"},
    ),
]
