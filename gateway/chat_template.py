"""The one chat template that both the simulator and the gateway use to turn messages into tokens.

vLLM renders chat messages with the served model's Jinja template and then tokenizes the
whole string.  We need the gateway to predict exactly which tokens a replica will cache,
and we need it to tokenize only a bounded leading window, so the template is rendered as a
list of *segments* that are tokenized one by one and concatenated.  Segment boundaries
are therefore token boundaries, which makes the leading tokens of a prompt independent of
anything that comes later (a property BPE over one long string does not have).

Template (ChatML-like), one segment per item:

1. if ``tools`` are given: ``<|im_start|>tools\\n{compact JSON of tools}<|im_end|>\\n``
2. each message: ``<|im_start|>{role}[ name={name}]\\n{content}[{tool_calls JSON}]<|im_end|>\\n``
   where list content is the concatenation of its text parts, and a non-text part becomes
   ``<|{type}|>`` followed by its URL/data if any (a stand-in for multimodal placeholders)
3. the generation prompt ``<|im_start|>assistant\\n`` (unless ``add_generation_prompt`` is false)

Special-token strings are tokenized as ordinary text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from gateway.tokenizer import Tokenizer

GENERATION_PROMPT = "<|im_start|>assistant\n"


def _compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def render_content(content: Any) -> str:
    """Flatten OpenAI message content (string, None, or a list of parts) to text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces: list[str] = []
        for part in content:
            if isinstance(part, Mapping):
                kind = part.get("type", "text")
                if kind == "text":
                    pieces.append(str(part.get("text", "")))
                else:
                    payload = part.get(kind)
                    if isinstance(payload, Mapping):
                        payload = payload.get("url") or payload.get("data") or ""
                    pieces.append(f"<|{kind}|>{payload or ''}")
            else:
                pieces.append(str(part))
        return "".join(pieces)
    return str(content)


def render_message(message: Mapping[str, Any]) -> str:
    """One message as one segment."""
    role = message.get("role", "user")
    name = message.get("name")
    header = f"<|im_start|>{role}" + (f" name={name}" if name else "") + "\n"
    body = render_content(message.get("content"))
    tool_calls = message.get("tool_calls")
    if tool_calls:
        body += _compact_json(tool_calls)
    return f"{header}{body}<|im_end|>\n"


def render_tools(tools: Any) -> str:
    return f"<|im_start|>tools\n{_compact_json(tools)}<|im_end|>\n"


def chat_segments(
    messages: Sequence[Mapping[str, Any]],
    tools: Any = None,
    add_generation_prompt: bool = True,
) -> Iterator[str]:
    """Yield the template's segments in order (lazily, so callers can stop early)."""
    if tools:
        yield render_tools(tools)
    for message in messages:
        yield render_message(message)
    if add_generation_prompt:
        yield GENERATION_PROMPT


def encode_segments(tokenizer: Tokenizer, segments: Iterable[str], max_tokens: int | None = None) -> list[int]:
    """Tokenize segments one by one; with ``max_tokens`` stop once that many tokens are known.

    The result may be longer than ``max_tokens`` (the last segment is not cut); callers
    that need an exact window slice it.  A single huge segment is tokenized only over a
    leading slice of its characters when a bound is given, so cost stays bounded.
    """
    tokens: list[int] = []
    for segment in segments:
        if max_tokens is not None:
            remaining = max_tokens - len(tokens)
            if remaining <= 0:
                break
            # A token is rarely longer than ~8 characters; cutting the text can only change
            # the pre-tokens at the cut, so two tokens of slack keep the kept ones exact.
            char_budget = remaining * 8 + 64
            if len(segment) > char_budget:
                partial = tokenizer.encode(segment[:char_budget])
                if len(partial) - 2 >= remaining:
                    tokens.extend(partial[:remaining])
                    break
        tokens.extend(tokenizer.encode(segment))
    return tokens


def chat_tokens(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Any = None,
    add_generation_prompt: bool = True,
    max_tokens: int | None = None,
) -> list[int]:
    """Token ids of a chat request exactly as the simulator (and our vLLM model) sees them."""
    return encode_segments(tokenizer, chat_segments(messages, tools, add_generation_prompt), max_tokens)
