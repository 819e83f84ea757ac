"""Normalize a request body so its stable prefix is byte-identical across requests.

Modes (per route, :class:`~gateway.prefix.settings.NormalizeSettings`):

- ``off``: nothing is scanned or changed.
- ``report``: volatile spans in scope are counted per rule; the body is untouched.
- ``relocate``: each span in scope is replaced *in place* by a stable placeholder
  ``{{volatile:<rule>:<n>}}`` (n counts per rule, in template order), and the original values
  are appended, labelled, after the stable part::

      <volatile_values>
      Current values of the {{volatile:...}} placeholders above:
      {{volatile:iso_datetime:1}} = 2025-03-04T05:06:07Z
      </volatile_values>

  Chat: appended to the last user message's content (a string gets ``"\\n\\n" + block``; a
  list of parts gets one more text part), or — per route — as a system message inserted
  before the last user message or after the last message.  Completions (string prompts): the
  block is inserted after the line that holds the last moved span, or at the very end.

Guarantees: every value is kept (it moves into the block); assistant and tool messages are
never read or written; a body with nothing to move is returned as the *same object*; the
input body is never mutated (changed containers are copied, the rest is shared);
relocation is deterministic and idempotent (placeholders and values blocks are never
spans, and scan budgets are measured in the rewritten text, so a second pass finds nothing).

Scope: chat messages whose role is in ``roles`` (default system and developer), the
``description`` strings of ``tools`` (function names and parameter names are never touched:
renaming them would break tool calls), at most ``max_scan_chars`` characters in template
order; completions: the leading ``completion_prefix_chars`` of each string prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.prefix.settings import NormalizeSettings
from gateway.prefix.volatile import (
    BLOCK_CLOSE,
    BLOCK_OPEN,
    Span,
    VolatileScanner,
    existing_placeholder_max,
    placeholder,
)


@dataclass(frozen=True, slots=True)
class Relocation:
    """One moved value: where it was, by which rule, its placeholder and the original text."""

    where: str  # e.g. "messages[0].content", "tools[1].function.description", "prompt"
    rule: str
    placeholder: str
    value: str


@dataclass(frozen=True, slots=True)
class NormalizeResult:
    """What normalization did to one body."""

    body: dict[str, Any]  # the same object as the input unless something was rewritten
    counts: dict[str, int] = field(default_factory=dict)  # rule -> spans found (report) or moved (relocate)
    relocated: bool = False  # spans were moved
    canonicalized: bool = False  # tool schemas were re-ordered
    changes: tuple[Relocation, ...] = ()  # for /admin/explain only (holds prompt text: never log it)

    @property
    def rewritten(self) -> bool:
        return self.relocated or self.canonicalized


# A text in scope: its location (for explain), the text, and how to build the new container.
_Setter = Callable[[str], None]


class Normalizer:
    """One route's normalization, with everything compiled once."""

    def __init__(self, settings: NormalizeSettings) -> None:
        self.settings = settings
        self.scanner = VolatileScanner(settings.detectors, settings.rules)
        self._roles = frozenset(settings.roles)
        self._active = settings.mode != "off" and not self.scanner.empty

    def apply(self, endpoint: str, body: dict[str, Any]) -> NormalizeResult:
        """Normalize ``body`` of ``endpoint`` ("chat" or "completions"; others pass through)."""
        if endpoint == "chat":
            return self._chat(body)
        if endpoint == "completions" and self._active:
            return self._completions(body)
        return NormalizeResult(body)

    # -- chat --------------------------------------------------------------------------
    def _chat(self, body: dict[str, Any]) -> NormalizeResult:
        settings = self.settings
        tools = body.get("tools")
        canonicalized = False
        if settings.canonicalize_tools and isinstance(tools, list) and tools:
            canonical = _sorted_json(tools)
            if canonical is not tools:
                tools, canonicalized = canonical, True
        messages = body.get("messages")
        if not self._active or not isinstance(messages, list):
            return self._result(body, tools, canonicalized)

        relocate = settings.mode == "relocate"
        budget = settings.max_scan_chars
        counts: dict[str, int] = {}
        plan: list[tuple[str, str, list[Span]]] = []  # (where, text, spans) of texts with spans
        texts: list[tuple[str, str]] = []
        for where, text in self._chat_texts(tools if settings.tools else None, messages):
            if budget <= 0:
                break
            texts.append((where, text))
            spans = self._accept(text, budget)
            new_len = len(text) + sum(len_delta(s) for s in spans) if relocate else len(text)
            budget -= new_len
            if spans:
                plan.append((where, text, spans))
                for s in spans:
                    counts[s.rule] = counts.get(s.rule, 0) + 1
        if not plan or not relocate:
            return self._result(body, tools, canonicalized, counts)

        # Number placeholders after any already present in scope, so they never collide.
        start_at: dict[str, int] = {}
        for _where, text in texts:
            for rule, top in existing_placeholder_max(text).items():
                start_at[rule] = max(start_at.get(rule, 0), top)
        numbering = _Numbering(start_at)
        replacements: dict[str, str] = {}
        changes: list[Relocation] = []
        for where, text, spans in plan:
            replacements[where] = _rewrite(text, spans, where, numbering, changes)

        new_tools = _replace_tool_texts(tools, replacements) if tools is not None else None
        new_messages = _replace_message_texts(messages, replacements)
        block = self._block(changes)
        new_messages = self._place(new_messages, block)
        new_body = dict(body)
        new_body["messages"] = new_messages
        if new_tools is not None:
            new_body["tools"] = new_tools
        return NormalizeResult(new_body, counts, True, canonicalized, tuple(changes))

    def _result(
        self, body: dict[str, Any], tools: Any, canonicalized: bool, counts: dict[str, int] | None = None
    ) -> NormalizeResult:
        if canonicalized:
            body = dict(body)
            body["tools"] = tools
        return NormalizeResult(body, counts or {}, False, canonicalized)

    def _chat_texts(self, tools: Any, messages: list[Any]) -> Iterator[tuple[str, str]]:
        """In-scope texts in template order (tools first, then messages)."""
        if isinstance(tools, list):
            for i, tool in enumerate(tools):
                yield from _descriptions(tool, f"tools[{i}]")
        roles = self._roles
        for i, message in enumerate(messages):
            # JSON bodies hold plain dicts: a dict check is ~10x cheaper than an ABC check.
            if type(message) is not dict or message.get("role") not in roles:
                continue
            content = message.get("content")
            if type(content) is str:
                yield f"messages[{i}].content", content
            elif type(content) is list:
                for j, part in enumerate(content):
                    if type(part) is dict and part.get("type", "text") == "text":
                        text = part.get("text")
                        if type(text) is str:
                            yield f"messages[{i}].content[{j}].text", text

    def _accept(self, text: str, limit: int) -> list[Span]:
        """Spans that start before ``limit`` *in the rewritten text* (this keeps relocation idempotent)."""
        if self.settings.mode != "relocate":
            return self.scanner.scan(text, limit)
        margin = 1024
        while True:
            spans = self.scanner.scan(text, limit + margin)
            accepted: list[Span] = []
            shift = 0
            for s in spans:
                if s.start + shift >= limit:
                    break
                accepted.append(s)
                shift += len_delta(s)
            if -shift <= margin or limit + margin >= len(text):
                return accepted
            margin = -shift + 1024

    def _block(self, changes: list[Relocation]) -> str:
        lines = [BLOCK_OPEN]
        if self.settings.values_note:
            lines.append(self.settings.values_note)
        lines.extend(f"{c.placeholder} = {c.value}" for c in changes)
        lines.append(BLOCK_CLOSE)
        return "\n".join(lines)

    def _place(self, messages: list[Any], block: str) -> list[Any]:
        placement = self.settings.placement
        last_user = next(
            (i for i in range(len(messages) - 1, -1, -1) if _role(messages[i]) == "user"),
            None,
        )
        out = list(messages)
        if placement == "last_user" and last_user is not None:
            message = dict(out[last_user])
            content = message.get("content")
            if isinstance(content, list):
                message["content"] = [*content, {"type": "text", "text": block}]
            elif isinstance(content, str) and content:
                message["content"] = f"{content}\n\n{block}"
            else:
                message["content"] = block
            out[last_user] = message
        elif placement == "system_before_last_user" and last_user is not None:
            out.insert(last_user, {"role": "system", "content": block})
        else:  # trailing_system, or no user message to attach to
            out.append({"role": "system", "content": block})
        return out

    # -- completions -------------------------------------------------------------------
    def _completions(self, body: dict[str, Any]) -> NormalizeResult:
        prompt = body.get("prompt")
        relocate = self.settings.mode == "relocate"
        counts: dict[str, int] = {}
        changes: list[Relocation] = []
        if isinstance(prompt, str):
            new_prompt = self._completion_prompt(prompt, "prompt", counts, changes)
            if new_prompt is prompt or not relocate:
                return NormalizeResult(body, counts)
            new_body = dict(body)
            new_body["prompt"] = new_prompt
            return NormalizeResult(new_body, counts, True, False, tuple(changes))
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            new_list = [self._completion_prompt(p, f"prompt[{i}]", counts, changes) for i, p in enumerate(prompt)]
            if not relocate or all(a is b for a, b in zip(new_list, prompt, strict=True)):
                return NormalizeResult(body, counts)
            new_body = dict(body)
            new_body["prompt"] = new_list
            return NormalizeResult(new_body, counts, True, False, tuple(changes))
        return NormalizeResult(body)

    def _completion_prompt(self, prompt: str, where: str, counts: dict[str, int], changes: list[Relocation]) -> str:
        spans = self._accept(prompt, self.settings.completion_prefix_chars)
        for s in spans:
            counts[s.rule] = counts.get(s.rule, 0) + 1
        if not spans or self.settings.mode != "relocate":
            return prompt
        mine: list[Relocation] = []
        numbering = _Numbering(existing_placeholder_max(prompt))
        new_text = _rewrite(prompt, spans, where, numbering, mine)
        changes.extend(mine)
        block = self._block(mine)
        if self.settings.completion_placement == "end":
            return f"{new_text}\n{block}"
        last = spans[-1]
        end_in_new = last.end + sum(len_delta(s) for s in spans)
        newline = new_text.find("\n", end_in_new)
        if newline == -1:
            return f"{new_text}\n{block}"
        return f"{new_text[: newline + 1]}{block}\n{new_text[newline + 1 :]}"


# --- helpers --------------------------------------------------------------------------
class _Numbering:
    """Per-rule placeholder counters (1-based), continuing after existing placeholders."""

    def __init__(self, start_at: Mapping[str, int]) -> None:
        self._next = dict(start_at)

    def take(self, rule: str) -> int:
        n = self._next.get(rule, 0) + 1
        self._next[rule] = n
        return n


def len_delta(span: Span) -> int:
    """How much longer the text gets when ``span`` becomes a placeholder (index assumed 1 digit).

    Budgets only need a deterministic function of the span that is the same on every pass;
    an exact index length is not required.
    """
    return len(placeholder(span.rule, 1)) - (span.end - span.start)


def _rewrite(text: str, spans: list[Span], where: str, numbering: _Numbering, changes: list[Relocation]) -> str:
    pieces: list[str] = []
    cursor = 0
    for s in spans:
        pieces.append(text[cursor : s.start])
        token = placeholder(s.rule, numbering.take(s.rule))
        pieces.append(token)
        changes.append(Relocation(where, s.rule, token, text[s.start : s.end]))
        cursor = s.end
    pieces.append(text[cursor:])
    return "".join(pieces)


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def _descriptions(node: Any, path: str) -> Iterator[tuple[str, str]]:
    """``description`` strings anywhere in a tool definition, depth first in key order."""
    if isinstance(node, dict):
        for key, value in node.items():
            sub = f"{path}.{key}"
            if key == "description" and isinstance(value, str):
                yield sub, value
            elif isinstance(value, dict | list):
                yield from _descriptions(value, sub)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if isinstance(value, dict | list):
                yield from _descriptions(value, f"{path}[{i}]")


def _replace_tool_texts(tools: Any, replacements: Mapping[str, str]) -> Any:
    if not any(k.startswith("tools[") for k in replacements):
        return tools
    return _rebuild(tools, "tools", replacements)


def _rebuild(node: Any, path: str, replacements: Mapping[str, str]) -> Any:
    """Copy only the containers on a path to a replaced string; share everything else."""
    if isinstance(node, dict):
        out: dict[str, Any] | None = None
        for key, value in node.items():
            sub = f"{path}.{key}"
            if isinstance(value, str):
                new = replacements.get(sub, value) if key == "description" else value
            elif isinstance(value, dict | list):
                new = _rebuild(value, sub, replacements)
            else:
                continue
            if new is not value:
                if out is None:
                    out = dict(node)
                out[key] = new
        return node if out is None else out
    if isinstance(node, list):
        new_list: list[Any] | None = None
        for i, value in enumerate(node):
            if isinstance(value, dict | list):
                new = _rebuild(value, f"{path}[{i}]", replacements)
                if new is not value:
                    if new_list is None:
                        new_list = list(node)
                    new_list[i] = new
        return node if new_list is None else new_list
    return node


def _replace_message_texts(messages: list[Any], replacements: Mapping[str, str]) -> list[Any]:
    """Copy the messages list and only the messages/parts that have a replaced text."""
    out = list(messages)
    touched: dict[int, list[tuple[int | None, str]]] = {}
    for where, text in replacements.items():
        if not where.startswith("messages["):
            continue
        index, _, rest = where[len("messages[") :].partition("]")
        part = None if rest == ".content" else int(rest[len(".content[") :].partition("]")[0])
        touched.setdefault(int(index), []).append((part, text))
    for i, edits in touched.items():
        message = dict(messages[i])
        for part, text in edits:
            if part is None:
                message["content"] = text
            else:
                if message["content"] is messages[i]["content"]:
                    message["content"] = list(message["content"])
                new_part = dict(message["content"][part])
                new_part["text"] = text
                message["content"][part] = new_part
        out[i] = message
    return out


def _sorted_json(value: Any) -> Any:
    """``value`` with every object's keys sorted; the same object when already sorted."""
    if isinstance(value, dict):
        items = [(k, _sorted_json(v)) for k, v in value.items()]
        keys = [k for k, _ in items]
        changed = any(new is not value[k] for k, new in items) or keys != sorted(keys)
        return dict(sorted(items)) if changed else value
    if isinstance(value, list):
        items_list = [_sorted_json(v) for v in value]
        return items_list if any(a is not b for a, b in zip(items_list, value, strict=True)) else value
    return value
