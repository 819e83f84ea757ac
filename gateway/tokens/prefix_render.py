"""Render only the leading messages of a conversation that the token window needs (``hf:DIR``).

Only the first ``window_tokens`` of a prompt are tokenized, but a model's Jinja template
renders the whole conversation: a 400-message agent transcript costs a full render (tens of
milliseconds of pure Python, on the event loop) on every request, for a window that its first
dozen messages fill.  So :class:`PrefixRendering` renders growing prefixes of the messages
(a guess from their lengths, then doubling), each cut right after a ``user`` message and
without the generation prompt, and stops at the first whose text fills the window.

Why that is exact: when the rendering of ``messages[:k]`` is a prefix of the rendering of all
of them, every text run and special token of it that ends at least one special token's length
before its end is also a run or token of the full rendering (the split at added tokens finds
the same matches there), so tokenizing those pieces gives the full rendering's first tokens.
The rest of the prefix's text (the run its end cuts) is left out.

Whether a template renders prefixes as prefixes is a property of the template, not of Python:
most do (each message is rendered on its own), some do not (Qwen3 marks assistant turns after
the *last* user query differently: cutting right after a user message keeps that true too).
So the property is checked, twice:

- at load, on probe conversations (system prompt, tools, tool calls and results, reasoning,
  a tool result sent as a user message): every cut must render as a prefix of the whole, and
  at least one must be compared; a template that fails any
  renders in full, always (:attr:`PrefixRendering.stable`);
- on live requests, the first ``VERIFY_FIRST`` served from a prefix and then one in
  ``VERIFY_EVERY`` render in full too and compare: a mismatch (a branch no probe took) turns
  prefix rendering off for the template for good, that request uses the full rendering, and
  ``mismatches`` counts it (logged once, without prompt text).

Why not render off the event loop instead: Jinja rendering is pure Python and holds the GIL, so
a thread would still stall the loop's other requests for most of it; rendering less is what
makes it cheaper.

A conversation whose window its messages do not fill (short ones, or one long last message)
is rendered in full, as before.  Cost: about 1.1 to 2 times the rendering of the messages the
window needs (one or two prefixes), instead of all of them.
"""

from __future__ import annotations

import logging
import re
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gateway.tokens.chat_template import SpecialToken

log = logging.getLogger("prefix_gateway.tokens")

VERIFY_FIRST = 16
VERIFY_EVERY = 256  # a checked request renders twice: rare enough to stay out of the p99
# English runs ~4 characters a token in the large vocabularies (cl100k, Llama 3, Qwen) and
# templates add a few tokens a message: a first prefix of 4 characters of content a window token
# fills the window mostly at once; one more, sized from what it measured, when it does not
GUESS_CHARS_PER_TOKEN = 4

# render(converted messages, converted tools, add_generation_prompt) -> text
Render = Callable[[list[dict[str, Any]], Any, bool], str]
Measure = Callable[[Iterable[str]], tuple["array[int]", float | None]]

_WEATHER = {"name": "get_weather", "description": "Weather.", "parameters": {"type": "object"}}
_TOOLS = [{"type": "function", "function": _WEATHER}]
_CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _probes() -> list[tuple[list[dict[str, Any]], Any]]:
    """Conversations whose every user-message cut a prefix-stable template renders as a prefix."""
    chat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "clear, 21"},
        {"role": "assistant", "content": "Clear, 21 degrees."},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "Rain.", "reasoning_content": "Look it up."},
        {"role": "user", "content": "<tool_response>\nclear\n</tool_response>"},
        {"role": "assistant", "content": "Noted.", "reasoning_content": "A result."},
        {"role": "user", "content": "Thanks.\nBye."},
        {"role": "assistant", "content": "<think>\nok\n</think>\n\nBye."},
        {"role": "user", "content": "One more."},
    ]
    no_system = chat[1:]
    alternating = [m for m in no_system if m["role"] in ("user", "assistant") and "tool_calls" not in m]
    return [(chat, None), (chat, _TOOLS), (no_system, None), (no_system, _TOOLS), (alternating, None)]


class PrefixRendering:
    """Leading-window rendering for one template (see the module docstring)."""

    def __init__(
        self,
        render: Render,
        split: re.Pattern[str],
        specials: Mapping[str, SpecialToken],
        convert: Callable[[Sequence[Any]], list[dict[str, Any]]],
    ) -> None:
        self._render = render
        self._convert = convert  # request messages -> the template's (vllm_messages: message by message)
        self._split = split
        self._specials = specials
        self._guard = max(map(len, specials), default=0)  # a piece must end this far before the cut
        self.served = 0  # requests whose window came from a prefix rendering
        self.checked = 0  # of them, rendered in full too and compared
        self.mismatches = 0
        self.stable = self._probe()

    def _probe(self) -> bool:
        """Every probe cut renders as a prefix of its whole, and at least one was compared."""
        compared = 0
        for raw, tools in _probes():
            messages = self._convert(raw)
            try:
                full = self._render(messages, tools, True)
            except Exception:  # the template refuses this shape (e.g. no system role): another probe decides
                continue
            for k in _user_cuts(messages):
                try:
                    part = self._render(messages[:k], tools, False)
                except Exception:  # a prefix it cannot render: at run time the next cut is tried
                    continue
                if not full.startswith(part):
                    return False
                compared += 1
        return compared > 0

    def pieces(self, text: str) -> list[str]:
        """The segments of ``text`` (split at added tokens) that end ``_guard`` characters before its end."""
        limit = len(text) - self._guard
        out: list[str] = []
        pos = 0
        specials = self._specials
        for match in self._split.finditer(text):
            start, end = match.span()
            if end > limit:
                break
            if start > pos:
                out.append(text[pos:start])
            out.append(specials.get(match.group(), match.group()))
            pos = end
        return out

    def window(
        self, messages: Sequence[Any], tools: Any, window: int, measure: Measure
    ) -> tuple[array[int], float | None] | None:
        """The first ``window`` tokens (and bytes per token) from a prefix rendering; None when the
        whole conversation must be rendered (unstable template, or no prefix fills the window).

        ``messages`` as the request has them (converted here only as far as rendered: the
        conversion is per message), ``tools`` already converted.  The first prefix holds
        ``GUESS_CHARS_PER_TOKEN`` characters of content a window token; one that falls short
        is followed by one scaled by what it measured (its characters per token), 10% over.
        """
        if not self.stable:
            return None
        cuts = [k for k in _user_cuts(messages) if k < len(messages)]  # cutting at the end saves nothing
        chars = _content_chars_at(messages, cuts)
        if not cuts or chars[-1] < window:  # a window these messages cannot fill: render it whole at once
            return None
        i = bisect_left(chars, GUESS_CHARS_PER_TOKEN * window, hi=len(cuts) - 1)
        while True:
            try:
                text: str | None = self._render(self._convert(messages[: cuts[i]]), tools, False)
            except Exception:  # a prefix this template cannot render: a longer one may do
                text = None
            got = 0
            if text is not None:
                ids, ratio = measure(self.pieces(text))
                if len(ids) >= window:
                    return self._checked(messages, tools, text, (ids, ratio))
                got = len(ids)
            if i == len(cuts) - 1:
                return None
            want = chars[i] * window / got * 1.1 if got else 2 * chars[i]
            i = max(i + 1, bisect_left(chars, want, hi=len(cuts) - 1))

    def _checked(
        self, messages: Sequence[Any], tools: Any, text: str, found: tuple[array[int], float | None]
    ) -> tuple[array[int], float | None] | None:
        """``found``, unless this request is one of the sampled ones and the full rendering disagrees."""
        self.served += 1
        if self.served > VERIFY_FIRST and self.served % VERIFY_EVERY:
            return found
        self.checked += 1
        try:
            full = self._render(self._convert(messages), tools, True)
        except Exception:  # the full conversation does not render (vLLM answers 400): the prefix keys it
            return found
        if full.startswith(text):
            return found
        self.mismatches += 1
        self.stable = False
        log.warning(
            "chat template: a prefix of a conversation rendered differently from the whole; "
            "rendering whole conversations from now on (this template's output depends on later messages)"
        )
        return None


def _user_cuts(messages: Sequence[Any]) -> list[int]:
    """Prefix lengths ending right after a user message, shortest first.

    Not after a user message that carries a tool's result (``<tool_response>...``, the Qwen
    family's convention): Qwen3's template does not count it as the last query, so a prefix
    ending there renders earlier assistant turns differently from the whole.
    """
    return [i + 1 for i, m in enumerate(messages) if isinstance(m, Mapping) and _is_query(m)]


def _is_query(message: Mapping[str, Any]) -> bool:
    if message.get("role") != "user":
        return False
    content = message.get("content")
    return not (isinstance(content, str) and content.lstrip().startswith("<tool_response>"))


def _content_chars(message: Any) -> int:
    content = message.get("content") if isinstance(message, Mapping) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return 0


def _content_chars_at(messages: Sequence[Any], cuts: list[int]) -> list[int]:
    """Characters of message content before each cut (a cheap stand-in for its tokens)."""
    out: list[int] = []
    chars = done = 0
    for k in cuts:
        chars += sum(map(_content_chars, messages[done:k]))
        done = k
        out.append(chars)
    return out
