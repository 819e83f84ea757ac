"""Normalize a request body so its stable prefix is byte-identical across requests.

Modes (per route, :class:`~gateway.prefix.settings.NormalizeSettings`):

- ``off``: nothing is scanned or changed.
- ``report``: volatile spans in scope are counted per rule; the body is untouched.
- ``relocate``: each span in scope *that varies* is replaced in place by a stable placeholder
  ``{{volatile:<rule>:<n>}}`` (n counts per rule, in template order), and the original values
  are appended, labelled, at the end of the prompt::

      <volatile_values check="1a2b3c4d">
      {{volatile:iso_datetime:1}} = 2025-03-04T05:06:07Z
      </volatile_values>

What moves: a span of a route's own rule (``always``, the default for rules) or of a detector
listed in ``always``; any other detected span only once its value has been seen to change at
the same place (:mod:`gateway.prefix.learn`) — a value that never changes stays byte for byte
("static").  Detected spans inside code (fenced or inline) or an embedded JSON document are
never moved by a built-in detector ("protected", :mod:`gateway.prefix.structure`).

Placement (chat, ``placement: end``, the default): appended to the last message when it is a
user, tool, system or developer message (a string gets ``"\\n\\n" + block``, a list of parts one
more text part), else a trailing system message.  At the end, step k+1 of an agent loop and
turn k+1 of a conversation share everything of step k but the block (docs/prefix-routing.md
has the measured alternatives).  Completions: at the very end by default.

Guarantees: every moved value is kept (it is in the block); assistant messages are never
read or written, tool messages only get the block appended; a body with nothing to move is
returned as the *same object*; the input body is never mutated (changed containers are
copied, the rest is shared); relocation is deterministic given the learner's state and
idempotent (placeholders and our checksummed block are never spans, and scan budgets are
measured in the rewritten text, so a second pass finds nothing to move).

Scope: chat messages whose role is in ``roles`` (default system and developer), the
``description`` strings of ``tools`` (function names and parameter names are never touched:
renaming them would break tool calls), at most ``max_scan_chars`` characters in template
order; completions: the leading ``completion_prefix_chars`` of each string prompt.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.prefix.discover import LEARNED, MASK, DiscoveredRule, SpanDiscoverer
from gateway.prefix.learn import VarianceLearner, context_key
from gateway.prefix.settings import DETECTORS, NormalizeSettings
from gateway.prefix.structure import covered, structured_ranges
from gateway.prefix.volatile import (
    Span,
    VolatileScanner,
    existing_placeholder_max,
    mask_placeholders,
    placeholder,
    values_block,
)


@dataclass(frozen=True, slots=True)
class Relocation:
    """One moved value: where it was, by which rule, its placeholder and the original text."""

    where: str  # e.g. "messages[0].content", "tools[1].function.description", "prompt"
    rule: str
    placeholder: str
    value: str


@dataclass(frozen=True, slots=True)
class Kept:
    """A detected span left in place, and why: ``static`` (not seen changing), ``protected``
    (inside code/JSON), or, in report mode, ``varies`` (relocate would move it)."""

    where: str
    rule: str
    status: str
    value: str  # for /admin/explain only (prompt text: never log it)


@dataclass(frozen=True, slots=True)
class NormalizeResult:
    """What normalization did to one body."""

    body: dict[str, Any]  # the same object as the input unless something was rewritten
    counts: dict[str, int] = field(default_factory=dict)  # rule -> spans found (report) or moved (relocate)
    relocated: bool = False  # spans were moved
    canonicalized: bool = False  # tool schemas were re-ordered
    changes: tuple[Relocation, ...] = ()  # for /admin/explain only (holds prompt text: never log it)
    kept: tuple[Kept, ...] = ()  # detected but left in place (static or protected), for explain

    @property
    def rewritten(self) -> bool:
        return self.relocated or self.canonicalized


MOVE, STATIC, PROTECTED = "moved", "static", "protected"
# Roles whose message may carry the values block at the end of the prompt ("end" placement).
_CARRIERS = frozenset({"user", "tool", "system", "developer"})


@dataclass(slots=True)
class _TextPlan:
    """What happens to one in-scope text."""

    where: str
    text: str
    moved: list[Span]
    kept: list[tuple[Span, str]]
    new_len: int


class Normalizer:
    """One route's normalization, with everything compiled once and a learner of what varies."""

    def __init__(self, settings: NormalizeSettings) -> None:
        self.settings = settings
        self.scanner = VolatileScanner(settings.detectors, settings.rules)
        self._roles = frozenset(settings.roles)
        self._active = settings.mode != "off" and (not self.scanner.empty or settings.learn.discover)
        self._user_always = frozenset(r.name for r in settings.rules if r.always)
        self._user_rules = frozenset(r.name for r in settings.rules)
        self._always = frozenset(DETECTORS if "*" in settings.always else settings.always)
        learn = settings.learn
        self.learner = VarianceLearner(learn.max_places, learn.expire_s, learn.examples == "raw")
        self.discoverer: SpanDiscoverer | None = None
        if learn.discover and learn.max_discovered and settings.mode != "off":
            self.discoverer = SpanDiscoverer(learn.max_discovered, learn.expire_s, learn.examples == "raw")
        self.tally: dict[str, list[int]] = {}  # rule -> [found, moved, static, protected], real requests only
        self._tally_lock = threading.Lock()

    def apply(self, endpoint: str, body: dict[str, Any], *, learn: bool = True) -> NormalizeResult:
        """Normalize ``body`` of ``endpoint`` ("chat" or "completions"; others pass through).

        ``learn=False`` (``/admin/explain``'s dry run): decide with what is known, record nothing.
        """
        if endpoint == "chat":
            return self._chat(body, learn)
        if endpoint == "completions" and self._active:
            return self._completions(body, learn)
        return NormalizeResult(body)

    # -- chat --------------------------------------------------------------------------
    def _chat(self, body: dict[str, Any], learn: bool) -> NormalizeResult:
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
        plans: list[_TextPlan] = []
        texts: list[str] = []
        for where, text in self._chat_texts(tools if settings.tools else None, messages):
            if budget <= 0:
                break
            texts.append(text)
            plan = self._plan(where, text, budget, learn)
            budget -= plan.new_len
            if plan.moved or plan.kept:
                plans.append(plan)
                for s in plan.moved:
                    counts[s.rule] = counts.get(s.rule, 0) + 1
                if not relocate:
                    for s, _status in plan.kept:
                        counts[s.rule] = counts.get(s.rule, 0) + 1
        kept = tuple(Kept(p.where, s.rule, status, p.text[s.start : s.end]) for p in plans for s, status in p.kept)
        moving = [p for p in plans if p.moved]
        if not moving:
            return self._result(body, tools, canonicalized, counts, kept)

        # Number placeholders after any already present in scope, so they never collide.
        start_at: dict[str, int] = {}
        for text in texts:
            for rule, top in existing_placeholder_max(text).items():
                start_at[rule] = max(start_at.get(rule, 0), top)
        numbering = _Numbering(start_at)
        replacements: dict[str, str] = {}
        changes: list[Relocation] = []
        for plan in moving:
            replacements[plan.where] = _rewrite(plan.text, plan.moved, plan.where, numbering, changes)

        new_tools = _replace_tool_texts(tools, replacements) if tools is not None else None
        new_messages = _replace_message_texts(messages, replacements)
        new_messages = self._place(new_messages, self._block(changes))
        new_body = dict(body)
        new_body["messages"] = new_messages
        if new_tools is not None:
            new_body["tools"] = new_tools
        return NormalizeResult(new_body, counts, True, canonicalized, tuple(changes), kept)

    def _result(
        self,
        body: dict[str, Any],
        tools: Any,
        canonicalized: bool,
        counts: dict[str, int] | None = None,
        kept: tuple[Kept, ...] = (),
    ) -> NormalizeResult:
        if canonicalized:
            body = dict(body)
            body["tools"] = tools
        return NormalizeResult(body, counts or {}, False, canonicalized, (), kept)

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

    # -- deciding what moves -----------------------------------------------------------
    def _plan(self, where: str, text: str, limit: int, learn: bool) -> _TextPlan:
        """Spans that start before ``limit`` *in the rewritten text*, split into moved and kept.

        Decisions are made without recording; then (real requests only) the text, with what
        is known to vary masked, is compared with the previous one at this field to discover
        spans no rule knows (a new discovery is applied to this very request), and what was
        accepted is recorded once.
        """
        plan, accepted = self._plan_once(where, text, limit)
        discoverer = self.discoverer
        if discoverer is not None:
            # explain (learn=False) asks the same question without storing the answer, so it
            # predicts exactly what the real request will do
            found = discoverer.observe(where, _stable_text(text, accepted, limit), commit=learn)
            if found:
                plan, accepted = self._plan_once(where, text, limit, found)
        if learn and accepted:
            self._record(where, text, accepted, self.settings.mode == "relocate")
        return plan

    def _plan_once(
        self, where: str, text: str, limit: int, discovered: list[DiscoveredRule] | None = None
    ) -> tuple[_TextPlan, list[tuple[Span, str, str | None]]]:
        """Budgets count the rewritten text, so a second pass over the output accepts exactly
        the same region (idempotency); the margin loop rescans when moves shrink the text a lot.
        """
        relocate = self.settings.mode == "relocate"
        margin = 1024
        while True:
            spans = self.scanner.scan(text, limit + margin)
            if self.discoverer is not None:
                found = self.discoverer.spans(where, mask_placeholders(text), limit + margin, discovered)
                if found:
                    spans = _merge(spans, found)
            decided = self._decide(where, text, spans)
            moved: list[Span] = []
            kept: list[tuple[Span, str]] = []
            accepted: list[tuple[Span, str, str | None]] = []
            shift = 0
            for s, status, context in decided:
                if s.start + shift >= limit:
                    break
                accepted.append((s, status, context))
                if status == MOVE and relocate:
                    moved.append(s)
                    shift += len_delta(s)
                else:  # report mode: a varying span stays too ("varies": relocate would move it)
                    kept.append((s, "varies" if status == MOVE else status))
            if -shift <= margin or limit + margin >= len(text):
                break
            margin = -shift + 1024
        return _TextPlan(where, text, moved, kept, len(text) + shift), accepted

    def _decide(self, where: str, text: str, spans: list[Span]) -> list[tuple[Span, str, str | None]]:
        """(span, moved/static/protected, learner context or None) for each span; records nothing."""
        if not spans:
            return []
        out: list[tuple[Span, str, str | None]] = []
        structure: list[tuple[int, int]] | None = None
        learner = self.learner
        n = len(spans)
        for i, s in enumerate(spans):
            rule = s.rule
            if rule in self._user_always:
                out.append((s, MOVE, None))
                continue
            if rule == LEARNED:  # discovered: it was seen changing (protected inside code/JSON)
                if structure is None:
                    structure = structured_ranges(text)
                out.append((s, PROTECTED if structure and covered(structure, s.start, s.end) else MOVE, None))
                continue
            if rule not in self._user_rules:
                if structure is None:
                    structure = structured_ranges(text)
                if structure and covered(structure, s.start, s.end):
                    out.append((s, PROTECTED, None))
                    continue
            if rule in self._always:
                out.append((s, MOVE, None))
                continue
            lo = spans[i - 1].end if i else 0
            hi = spans[i + 1].start if i + 1 < n else len(text)
            context = context_key(text, s.start, s.end, lo, hi)
            varies = learner.varies(rule, where, context, text[s.start : s.end])
            out.append((s, MOVE if varies else STATIC, context))
        return out

    def _record(self, where: str, text: str, accepted: list[tuple[Span, str, str | None]], relocate: bool) -> None:
        learner = self.learner
        with self._tally_lock:
            tally = self.tally
            for s, status, context in accepted:
                if context is not None:
                    # The pure decision and the recorded one agree (see VarianceLearner.varies).
                    learner.record(s.rule, where, context, text[s.start : s.end])
                elif s.rule == LEARNED and self.discoverer is not None:
                    self.discoverer.record_match(where, text, s)
                row = tally.get(s.rule)
                if row is None:
                    row = tally[s.rule] = [0, 0, 0, 0]
                row[0] += 1
                if status == MOVE:
                    row[1 if relocate else 2] += 1  # report mode moves nothing: a varying span stays too
                elif status == STATIC:
                    row[2] += 1
                else:
                    row[3] += 1

    def _block(self, changes: list[Relocation]) -> str:
        lines = [self.settings.values_note] if self.settings.values_note else []
        lines.extend(f"{c.placeholder} = {c.value}" for c in changes)
        return values_block(lines)

    def _place(self, messages: list[Any], block: str) -> list[Any]:
        placement = self.settings.placement
        out = list(messages)
        if placement == "end":
            target = len(out) - 1 if out and _role(out[-1]) in _CARRIERS else None
        else:
            target = next((i for i in range(len(out) - 1, -1, -1) if _role(out[i]) == "user"), None)
        if placement in ("end", "last_user") and target is not None:
            message = dict(out[target])
            content = message.get("content")
            if isinstance(content, list):
                message["content"] = [*content, {"type": "text", "text": block}]
            elif isinstance(content, str) and content:
                message["content"] = f"{content}\n\n{block}"
            else:
                message["content"] = block
            out[target] = message
        elif placement == "system_before_last_user" and target is not None:
            out.insert(target, {"role": "system", "content": block})
        else:  # trailing_system, or nothing to attach to
            out.append({"role": "system", "content": block})
        return out

    # -- completions -------------------------------------------------------------------
    def _completions(self, body: dict[str, Any], learn: bool) -> NormalizeResult:
        prompt = body.get("prompt")
        relocate = self.settings.mode == "relocate"
        counts: dict[str, int] = {}
        changes: list[Relocation] = []
        kept: list[Kept] = []
        if isinstance(prompt, str):
            new_prompt = self._completion_prompt(prompt, "prompt", counts, changes, kept, learn)
            if new_prompt is prompt or not relocate:
                return NormalizeResult(body, counts, kept=tuple(kept))
            new_body = dict(body)
            new_body["prompt"] = new_prompt
            return NormalizeResult(new_body, counts, True, False, tuple(changes), tuple(kept))
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            new_list = [
                self._completion_prompt(p, f"prompt[{i}]", counts, changes, kept, learn) for i, p in enumerate(prompt)
            ]
            if not relocate or all(a is b for a, b in zip(new_list, prompt, strict=True)):
                return NormalizeResult(body, counts, kept=tuple(kept))
            new_body = dict(body)
            new_body["prompt"] = new_list
            return NormalizeResult(new_body, counts, True, False, tuple(changes), tuple(kept))
        return NormalizeResult(body)

    def _completion_prompt(
        self,
        prompt: str,
        where: str,
        counts: dict[str, int],
        changes: list[Relocation],
        kept: list[Kept],
        learn: bool,
    ) -> str:
        plan = self._plan(where, prompt, self.settings.completion_prefix_chars, learn)
        for s in plan.moved:
            counts[s.rule] = counts.get(s.rule, 0) + 1
        for s, status in plan.kept:
            kept.append(Kept(where, s.rule, status, prompt[s.start : s.end]))
            if self.settings.mode != "relocate":
                counts[s.rule] = counts.get(s.rule, 0) + 1
        spans = plan.moved
        if not spans:
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
def _merge(spans: list[Span], more: list[Span]) -> list[Span]:
    """Both span lists in order, dropping any span that overlaps an earlier one."""
    out: list[Span] = []
    cursor = 0
    for s in sorted([*spans, *more], key=lambda s: (s.start, s.start - s.end)):
        if s.start >= cursor:
            out.append(s)
            cursor = s.end
    return out


def _stable_text(text: str, accepted: list[tuple[Span, str, str | None]], limit: int) -> str:
    """``text`` (its scanned part) with every span known to vary masked: what should repeat."""
    pieces: list[str] = []
    cursor = 0
    for s, status, _context in accepted:
        if status == MOVE or s.rule == LEARNED:
            pieces.append(text[cursor : s.start])
            pieces.append(MASK)
            cursor = s.end
    if not pieces:
        return text[: limit + 256]
    pieces.append(text[cursor:])
    return "".join(pieces)[: limit + 256]


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
