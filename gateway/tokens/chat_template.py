"""Chat templates as token-boundary segments, and the generic (ChatML-like) fallback template.

Which template a request gets is decided in :mod:`gateway.tokens.alignment` (``tokenizer: auto``
picks the served model's real template: :mod:`gateway.tokens.templates`).  This module holds what
every template shares: the :class:`ChatTemplate` protocol, the :class:`Alignment` pairing a
template with its tokenizer, :class:`SpecialToken` segments,
the view of messages that vLLM hands to a template (:func:`vllm_messages`), and the generic
template used when the model's family is unknown (predictions are then approximate).

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

Special-token strings are tokenized as ordinary text (in this generic layout only).

Model templates yield :class:`SpecialToken` segments for their own markup (``<|eot_id|>``,
``<|im_start|>``...): those become the special id, never BPE over the marker's text, while
special-token text inside message content becomes the special token too, as vLLM's
tokenizer makes it (:class:`gateway.tokens.templates.SpecialSplitter`).  Special tokens
split BPE, so text between two of them tokenizes the same alone as inside the whole prompt.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.tokens.tokenizer import Tokenizer

GENERATION_PROMPT = "<|im_start|>assistant\n"


class SpecialToken(str):
    """A template's special token: its text (so ``"".join(segments)`` is the rendered prompt)
    plus its id in the template's vocabulary (what the tokenizer must emit for it)."""

    id: int

    def __new__(cls, text: str, token_id: int) -> SpecialToken:
        obj = super().__new__(cls, text)
        obj.id = token_id
        return obj


class ChatTemplate(Protocol):
    """Renders a chat request as segments whose boundaries are token boundaries."""

    name: str
    #: True when the segments are byte-for-byte what the served model's template renders.
    exact: bool

    def segments(
        self, messages: Sequence[Any], tools: Any = None, add_generation_prompt: bool = True
    ) -> Iterator[str]: ...


@dataclass(frozen=True, slots=True)
class Alignment:
    """A tokenizer plus the template rendered with it; ``key`` identifies the pair."""

    key: str
    vocab: str  # how the vocabulary is named to operators: "llama3", "cl100k_base", "hf:/models/x"
    tokenizer: Tokenizer
    template: ChatTemplate
    #: False when the vocabulary is only a guess (an unknown model name got cl100k_base/o200k_base)
    tokenizer_known: bool = True

    @property
    def exact(self) -> bool:
        """Tokenizer and template are the served model's (block size aside: see gateway.prefix.exactness)."""
        return self.tokenizer_known and self.template.exact

    @property
    def units(self) -> str:
        return f"{'exact' if self.exact else 'approximate'} ({self.vocab})"

    def mismatches(self) -> list[str]:
        """What of tokenizer and template is not the served model's, for people (empty: both are)."""
        out = []
        if not self.tokenizer_known:
            out.append(f"tokenizer {self.vocab} guessed from the model name")
        if not self.template.exact:
            out.append(f"template {self.template.name} (not the model's)")
        return out


def _compact_json(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (RecursionError, ValueError, TypeError):  # absurdly nested input: key what we can
        return ""


def hf_tojson(value: Any, indent: int | None = None) -> str:
    """transformers' ``tojson`` filter (not jinja2's: no HTML escaping, keys unsorted)."""
    try:
        return json.dumps(value, ensure_ascii=False, indent=indent)
    except (RecursionError, ValueError, TypeError):
        return ""


def vllm_content(content: Any) -> str:
    """Message content as vLLM gives it to a string-format template.

    None is "", a string is itself, a list of parts is its text parts joined with newlines.
    Non-text parts (images, audio) have no text form here; their URL or data is appended as
    text so that different media never share routing keys (multimodal alignment is not
    modelled).  Anything else (numbers, deeply nested lists) contributes nothing: this never
    raises.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts: list[str] = []
    for part in content:
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type", "text")
        if kind == "text":
            text = part.get("text")
            if isinstance(text, str):
                texts.append(text)
        elif isinstance(kind, str):
            payload = part.get(kind)
            if isinstance(payload, Mapping):
                payload = payload.get("url") or payload.get("data")
            texts.append(f"<|{kind}|>{payload}" if isinstance(payload, str) else f"<|{kind}|>")
    return "\n".join(texts)


def vllm_tool_calls(tool_calls: Any) -> list[dict[str, Any]]:
    """Assistant tool calls as vLLM passes them: ``function.arguments`` parsed from JSON."""
    if not isinstance(tool_calls, list):
        return []
    out: list[dict[str, Any]] = []
    for call in tool_calls:
        if not isinstance(call, Mapping):
            continue
        function = call.get("function")
        function = dict(function) if isinstance(function, Mapping) else {}
        args = function.get("arguments")
        if isinstance(args, str):
            # unparsable: vLLM rejects the request; the text still keys it
            with contextlib.suppress(ValueError, RecursionError):
                function["arguments"] = json.loads(args) if args else {}
        elif args is None:
            function["arguments"] = {}
        name = function.get("name")
        function["name"] = name if isinstance(name, str) else ""
        out.append({**call, "function": function})
    return out


def vllm_message(message: Any) -> dict[str, Any] | None:
    """One message as vLLM hands it to a string-format template (None: not a message).

    ``role``, string ``content``, and ``tool_calls`` (assistant) / ``tool_call_id`` / ``name`` /
    ``reasoning_content`` when present.  Malformed input is skipped rather than raising.
    """
    if type(message) is not dict and not isinstance(message, Mapping):  # (dict first: ABC checks are slow)
        return None
    role = message.get("role")
    item: dict[str, Any] = {"role": role if isinstance(role, str) else "user"}
    item["content"] = vllm_content(message.get("content"))
    calls = message.get("tool_calls")
    if calls is not None and item["role"] == "assistant":
        item["tool_calls"] = vllm_tool_calls(calls)
    for key in ("tool_call_id", "name", "reasoning_content"):
        value = message.get(key)
        if isinstance(value, str):
            item[key] = value
    return item


def vllm_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The messages a vLLM chat template sees (see :func:`vllm_message`)."""
    return [m for m in map(vllm_message, messages) if m is not None]


def vllm_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` as vLLM passes them to a template (its pydantic ``model_dump``: declared
    fields first, ``description``/``parameters`` present even when null)."""
    if not isinstance(tools, list) or not tools:
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        function = tool.get("function")
        function = function if isinstance(function, Mapping) else {}
        fn = {
            "name": function.get("name"),
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        fn.update((k, v) for k, v in function.items() if k not in fn)
        entry = {"type": tool.get("type", "function"), "function": fn}
        entry.update((k, v) for k, v in tool.items() if k not in entry)
        out.append(entry)
    return out or None


def render_content(content: Any) -> str:
    """Flatten OpenAI message content (string, None, or a list of parts) to text.

    Never raises: parts that are not mappings, and values that are not strings (deeply
    nested lists, numbers), contribute nothing rather than their ``str()``.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces: list[str] = []
        for part in content:
            if isinstance(part, str):
                pieces.append(part)
            elif isinstance(part, Mapping):
                kind = part.get("type", "text")
                if kind == "text":
                    text = part.get("text", "")
                    pieces.append(text if isinstance(text, str) else "")
                elif isinstance(kind, str):
                    payload = part.get(kind)
                    if isinstance(payload, Mapping):
                        payload = payload.get("url") or payload.get("data") or ""
                    pieces.append(f"<|{kind}|>" + (payload if isinstance(payload, str) else ""))
        return "".join(pieces)
    if isinstance(content, int | float):
        return str(content)
    return ""


def render_message(message: Mapping[str, Any]) -> str:
    """One message as one segment."""
    if not isinstance(message, Mapping):
        return ""
    role = message.get("role", "user")
    role = role if isinstance(role, str) else "user"
    name = message.get("name")
    name = name if isinstance(name, str) else None
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


class GenericTemplate:
    """The ChatML-like fallback for models whose family is unknown (not their real template)."""

    name = "chatml-like"
    exact = False

    def segments(self, messages: Sequence[Any], tools: Any = None, add_generation_prompt: bool = True) -> Iterator[str]:
        return chat_segments(messages, tools, add_generation_prompt)


GENERIC = GenericTemplate()


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
