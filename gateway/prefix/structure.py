"""Where a prompt holds structure that a rewrite would corrupt: code and embedded JSON.

A detector match inside a fenced code block (``parse('2024-01-15')``), inline code, or a
JSON document pasted into a prompt (``{"ttl": 1741064767}``) is almost always part of a
fixed example, and replacing it with a placeholder would break the code or the JSON the
model is asked to read.  Normalization reports such spans instead of moving them (a
route's own regex rule still moves them: that is an explicit decision).

Only called for texts that have candidate spans, so ordinary prompts pay nothing.  The JSON
search is bounded (a fixed number of failed parse attempts) so a hostile prompt full of
unclosed braces costs O(n), not O(n²).
"""

from __future__ import annotations

import json
import re

_FENCE_OPEN = re.compile(r"(?m)^[ \t]{0,3}(`{3,}|~{3,})[^\n]*$")
_INLINE = re.compile(r"`[^`\n]+`")
# A JSON document starts with "{" then a key, or "[" then a value.
_JSON_START = re.compile(r"\{\s*\"|\[\s*[\"\[{0-9-]")
_DECODER = json.JSONDecoder()
_MAX_FAILED_PARSES = 32
_MIN_JSON_CHARS = 8  # "[1]" or "[12, 3]" in prose is a citation, not a document


def structured_ranges(text: str) -> list[tuple[int, int]]:
    """Sorted, possibly overlapping ``(start, end)`` ranges of code and JSON in ``text``."""
    ranges: list[tuple[int, int]] = []
    fences: list[tuple[int, int]] = []
    if "`" in text or "~~~" in text:
        fences = _fenced(text)
        ranges.extend(fences)
        if "`" in text:
            for m in _INLINE.finditer(text):
                if not _inside(fences, m.start()):
                    ranges.append(m.span())
    if "{" in text or "[" in text:
        ranges.extend(_json_documents(text))
    ranges.sort()
    return ranges


def _fenced(text: str) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    pos = 0
    while True:
        m = _FENCE_OPEN.search(text, pos)
        if m is None:
            return out
        fence = m.group(1)
        close = re.compile(rf"(?m)^[ \t]{{0,3}}{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        c = close.search(text, m.end())
        end = len(text) if c is None else c.end()
        out.append((m.start(), end))
        pos = end
        if c is None:
            return out


def _json_documents(text: str) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    pos = 0
    failed = 0
    while failed < _MAX_FAILED_PARSES:
        m = _JSON_START.search(text, pos)
        if m is None:
            break
        start = m.start()
        try:
            _value, end = _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):  # deep nesting raises RecursionError
            failed += 1
            pos = start + 1
            continue
        if end - start >= _MIN_JSON_CHARS:
            out.append((start, end))
        pos = end
    return out


def _inside(ranges: list[tuple[int, int]], pos: int) -> bool:
    return any(lo <= pos < hi for lo, hi in ranges)


def covered(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether ``[start, end)`` overlaps any of ``ranges``."""
    return any(lo < end and start < hi for lo, hi in ranges)
