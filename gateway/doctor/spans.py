"""Find volatile spans no rule knows, by diffing requests that share a template.

Two requests with the same structure (same parts in the same roles) whose stable text is
identical except for one short run at the same place reveal a volatile value there: a
request id in an unknown format, a nonce, a date in a language no detector reads.  For
each such place this module gathers the values seen and suggests a regex rule that matches
them — anchored by the values' own literal prefix (``req_``) or, failing that, by the text
right before the span — so the operator can pin it in ``config/``.

Interface: :func:`find_spans` takes ``{where: [text, text, ...]}`` (the texts of one part
position across requests, oldest first, already normalized by the known rules so only
unknown changes remain) and returns :class:`LearnedSpan` records.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher

from gateway.prefix.learn import shape

# ASCII words and digit runs stay whole (an id is one token); any other letter is a token of
# its own, so a value glued to CJK text (``现在时间17:30``) is still told apart from it.
_TOKEN = re.compile(r"[A-Za-z0-9_]+|\d+|\w|\s+|[^\w\s]")
MAX_SPAN_CHARS = 96  # longer differences are content, not a volatile value
MAX_SPAN_TOKENS = 24
MIN_RIGHT_CONTEXT = 32  # a span in the stable prefix is followed by shared text
LEFT_CONTEXT = 24  # characters of text before a span that identify its place
MAX_PAIRS = 200  # successive pairs compared per part position (the diff is quadratic-ish)
MERGE_GAP_TOKENS = 2  # changed runs this close are one value ("9:01" vs "10:02")
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MIN_ANCHOR_SHARE = 0.5  # the text before a span must recur in this share of the texts: a stable place


@dataclass(slots=True)
class LearnedSpan:
    """A place where a short value changes between requests of one template."""

    where: str
    left: str  # the text right before the span (identifies its place)
    values: list[str] = field(default_factory=list)  # distinct values seen, in order, bounded
    changes: int = 0  # pairs of successive requests in which it changed
    pattern: str = ""
    name: str = ""

    @property
    def example_shape(self) -> str:
        """The first value with letters → ``a``/``A`` and digits → ``9``: its shape, not its text."""
        return shape(self.values[0]) if self.values else ""


def _offsets(tokens: Sequence[str]) -> list[int]:
    out = [0]
    for token in tokens:
        out.append(out[-1] + len(token))
    return out


def diff_spans(a: str, b: str) -> list[tuple[int, int, int, int]]:
    """Short differing runs between ``a`` and ``b`` followed by shared text: (a0, a1, b0, b1) char ranges."""
    ta, tb = _TOKEN.findall(a), _TOKEN.findall(b)
    oa, ob = _offsets(ta), _offsets(tb)
    matcher = SequenceMatcher(None, ta, tb, autojunk=False)
    runs: list[list[int]] = []  # [i1, i2, j1, j2] token ranges; runs split by a separator or two are one value
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        if runs and i1 - runs[-1][1] <= MERGE_GAP_TOKENS and j1 - runs[-1][3] <= MERGE_GAP_TOKENS:
            runs[-1][1], runs[-1][3] = i2, j2  # "9:01" vs "10:02": one time, not two numbers
        else:
            runs.append([i1, i2, j1, j2])
    spans: list[tuple[int, int, int, int]] = []
    for i1, i2, j1, j2 in runs:
        a0, a1, b0, b1 = _widen(a, b, oa[i1], oa[i2], ob[j1], ob[j2])
        if spans and a0 <= spans[-1][1]:  # widening joined it to the previous run
            a0, b0 = spans[-1][0], spans[-1][2]
            spans.pop()
        if max(i2 - i1, j2 - j1) > MAX_SPAN_TOKENS or max(a1 - a0, b1 - b0) > MAX_SPAN_CHARS:
            continue
        if a1 == a0 or b1 == b0:  # an insertion or deletion: a structural change, not a value
            continue
        if "{{" in a[a0:a1] + b[b0:b1]:  # a placeholder on one side: a known span, moved on one request only
            continue
        if len(a) - a1 < MIN_RIGHT_CONTEXT or len(b) - b1 < MIN_RIGHT_CONTEXT:
            continue  # at the very end: that is where per-request text belongs
        spans.append((a0, a1, b0, b1))
    return spans


def _widen(a: str, b: str, a0: int, a1: int, b0: int, b1: int) -> tuple[int, int, int, int]:
    """Grow a changed run over shared id characters on both sides: ``frost-ember-12`` vs
    ``frost-maple-34`` differ after ``frost-``, but the value is the whole code."""
    while a0 > 0 and b0 > 0 and a[a0 - 1] == b[b0 - 1] and a[a0 - 1] in _ID_CHARS:
        a0, b0 = a0 - 1, b0 - 1
    while a1 < len(a) and b1 < len(b) and a[a1] == b[b1] and a[a1] in _ID_CHARS:
        a1, b1 = a1 + 1, b1 + 1
    return a0, a1, b0, b1


def find_spans(texts: Mapping[str, Sequence[str]], min_changes: int = 2, max_values: int = 8) -> list[LearnedSpan]:
    """Volatile spans per part position; a place must change in ``min_changes`` pairs to count."""
    found: dict[tuple[str, str], LearnedSpan] = {}
    for where, seq in texts.items():
        pairs = 0
        for prev, cur in itertools.pairwise(seq):
            if prev == cur:
                continue
            pairs += 1
            if pairs > MAX_PAIRS:
                break
            stable_from = 0  # the left context never reaches into an earlier changed span
            for a0, a1, b0, b1 in diff_spans(prev, cur):
                left = cur[max(stable_from, b0 - LEFT_CONTEXT) : b0]
                left = left.rsplit("}}", 1)[-1]  # a placeholder is not in the raw text a rule is applied to
                stable_from = b1
                span = found.setdefault((where, left), LearnedSpan(where, left))
                span.changes += 1
                for value in (prev[a0:a1], cur[b0:b1]):
                    if value not in span.values and len(span.values) < max_values:
                        span.values.append(value)
    spans = [s for s in found.values() if s.changes >= min_changes and _anchored(s.left, texts[s.where])]
    for i, span in enumerate(spans, 1):
        span.pattern = suggest_pattern(span.left, span.values)
        span.name = f"learned_{i}"
    return spans


def _anchored(left: str, texts: Sequence[str]) -> bool:
    """True when ``left`` recurs in most texts: the span sits at one place of the template."""
    if not left:
        return True
    return sum(left in text for text in texts) >= MIN_ANCHOR_SHARE * len(texts)


def _char_class(chars: str) -> str:
    parts = []
    if any(c.isdigit() for c in chars):
        parts.append("0-9")
    if any("a" <= c <= "z" for c in chars):
        parts.append("a-z")
    if any("A" <= c <= "Z" for c in chars):
        parts.append("A-Z")
    others = sorted({c for c in chars if not (c.isascii() and c.isalnum())})
    parts.extend(re.escape(c) if c not in "-]\\^" else "\\" + c for c in others)
    return "[" + "".join(parts) + "]"


def _common_prefix(values: Sequence[str]) -> str:
    first = min(values, key=len)
    n = 0
    while n < len(first) and all(v[n] == first[n] for v in values):
        n += 1
    return first[:n]


def suggest_pattern(left: str, values: Sequence[str]) -> str:
    """A regex matching every value: literal prefix + one character class with the lengths seen.

    Without a literal prefix of at least 3 characters the pattern is anchored on the text
    before the span (a fixed-width lookbehind), so it cannot match look-alikes elsewhere.
    """
    if not values:
        return ""
    common = _common_prefix(values)
    head = re.match(r"[A-Za-z_]*[^A-Za-z0-9]?", common)
    literal = head.group(0) if head else ""
    if len(literal) < 3:
        literal = ""  # a shared first letter or two is chance, not a format
    rests = [v[len(literal) :] for v in values]
    body = ""
    if any(rests):
        lo, hi = min(len(r) for r in rests), max(len(r) for r in rests)
        if hi <= 2 and all(r.isdigit() for r in rests):
            lo, hi = 1, 2  # a day, hour or minute seen only as "4".."9" will also be "14"
        count = f"{{{lo}}}" if lo == hi else f"{{{max(lo, 1)},{hi}}}"
        body = _char_class("".join(rests)) + count
    pattern = re.escape(literal) + body
    if not literal:
        anchor = left[-12:]
        if anchor:
            pattern = f"(?<={re.escape(anchor)})" + pattern
    return pattern
