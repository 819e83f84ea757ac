"""Learn volatile spans that no detector or rule knows, from successive requests.

When two successive requests put different text at the same field (``messages[0].content``)
and, after masking what is already known to vary, the texts first part ways inside a short
value (``现在是2025年3月4日 星期二 17点30分`` in an unknown format, ``ticket TK-83KD-LL20``), that
value is volatile.  Finding it needs the previous request's text at that spot, which we must
not keep, so learning takes three requests and stores only hashes and one bounded excerpt:

1. request k: hashes of the text's 64-character chunks (no text);
2. request k+1: its chunks first differ from k's at chunk ``a``: keep an *excerpt* of request
   k+1 around that chunk (48 characters before it to 256 after, in memory only);
3. request k+2: where its text first differs from the excerpt, the value around that spot
   (digits, letters, ``_-`` and separators between digits, CJK date units) is a span; the
   walk resumes after it, so a few values close together are learned at once.  The rest of
   the excerpt must agree: a word that differs, or more than a few values, means another
   template (``tenant-00`` / ``tenant-01`` atop two tenants' different prompts), and nothing
   is learned.

The span becomes a *discovered rule*: the (up to 16) characters before it, literally, then a
pattern of the value's shape (:func:`gateway.prefix.learn.suggest_pattern`).  It is applied
like a route's own rule, from that request on.  Guards: the value must contain a digit (names
and words that differ between tenants are not values), be at most 96 characters, and have a
stable left context of at least 4 characters.  Bounded: one slot (hashes + excerpt) per field,
at most ``max_discovered`` rules per route; both expire.

Cost: hashing the text (C speed) when nothing changed; one pass of 64-character slice hashes
(~0.15 µs each) when it did.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from gateway.prefix.learn import digest, shape, suggest_pattern
from gateway.prefix.volatile import Span

CHUNK = 64
_MARGIN = 48  # excerpt characters before the first differing chunk
_AFTER = 256  # and after it: the texts must agree there but for values (same template)
_MAX_VALUE = 96
_CONTEXT = 16
_MIN_CONTEXT = 4
_MAX_PER_EXCERPT = 4  # values learned from one excerpt
_MAX_SLOTS = 256
MASK = "\x00"  # replaces spans already known to vary (never in JSON-decoded prompt text... rarely)
_UNITS = frozenset("年月日号时時点點分秒년월일시분초")
_SEPARATORS = frozenset(":./+,")
LEARNED = "learned"  # the rule name of discovered spans (placeholders, metrics)


def _is_core(ch: str) -> bool:
    return (ch.isascii() and (ch.isalnum() or ch in "_-")) or ch in _UNITS


def expand_value(text: str, pos: int) -> tuple[int, int]:
    """The value around ``pos``: runs of id characters, separators between digits, CJK units."""
    n = len(text)
    if pos >= n or not _is_core(text[pos]):
        if pos > 0 and _is_core(text[pos - 1]):
            pos -= 1
        else:
            return pos, pos
    start = pos
    while start > 0:
        ch = text[start - 1]
        if _is_core(ch) or (ch in _SEPARATORS and start >= 2 and text[start - 2].isdigit() and text[start].isdigit()):
            start -= 1
        else:
            break
    # A value never starts with a CJK unit (年 follows its digits).
    while start < pos and text[start] in _UNITS:
        start += 1
    end = pos + 1
    while end < n:
        ch = text[end]
        if _is_core(ch) or (ch in _SEPARATORS and end + 1 < n and text[end - 1].isdigit() and text[end + 1].isdigit()):
            end += 1
        else:
            break
    return start, end


def _is_value(text: str) -> bool:
    """Looks like a value, not a word: at most ``_MAX_VALUE`` characters, a digit, no mask."""
    return 0 < len(text) <= _MAX_VALUE and MASK not in text and any(c.isdigit() for c in text)


@dataclass(slots=True)
class DiscoveredRule:
    """A learned volatile spot: literal left context + value pattern, and what it has seen."""

    where: str
    left: str  # <= 16 characters of prompt text before the value (memory only, never shown)
    regex: re.Pattern[str]  # the left text literally, then group 1: the value
    pattern: str  # the suggested config pattern (shape-based, no prompt text)
    context: str  # digest of the left context (shown instead of the text)
    example: str
    value_hash: int
    seen: int = 1
    changes: int = 1
    last_seen: float = 0.0


@dataclass(slots=True)
class _Slot:
    length: int
    text_hash: int
    chunks: list[int]
    excerpt: str = ""  # bounded excerpt of the previous request around its first difference
    excerpt_at: int = -1
    last_seen: float = field(default=0.0)
    kept: int = 1  # requests whose text differed here while nothing was learned (warm-up)


class SpanDiscoverer:
    """Per route: slots of chunk hashes per field, and the rules discovered from them."""

    def __init__(self, max_rules: int = 32, expire_s: float = 3600.0, raw_examples: bool = False) -> None:
        self.max_rules = max_rules
        self.expire_s = expire_s
        self.raw_examples = raw_examples
        self._slots: OrderedDict[str, _Slot] = OrderedDict()
        self._rules: OrderedDict[tuple[str, str], DiscoveredRule] = OrderedDict()
        self._by_where: dict[str, list[DiscoveredRule]] = {}
        self._lock = threading.Lock()
        self.clock = time.monotonic
        self.warmup_misses = 0  # requests that kept a value in place before it was discovered

    # -- applying what was learned (every request) --------------------------------------
    def spans(self, where: str, text: str, end: int, extra: list[DiscoveredRule] | None = None) -> list[Span]:
        """Spans of discovered rules for this field (and ``extra`` ones) that start before ``end``."""
        rules = self._by_where.get(where)
        if extra:
            rules = [*(rules or ()), *extra]
        if not rules:
            return []
        out = []
        for rule in rules:
            m = rule.regex.search(text)
            if m is not None and m.start(1) < end and m.end(1) > m.start(1):
                out.append(Span(m.start(1), m.end(1), LEARNED))
        out.sort(key=lambda s: s.start)
        return out

    def record_match(self, where: str, text: str, span: Span) -> None:
        """Count one sighting of a discovered rule's value (seen / changes / example)."""
        now = self.clock()
        value = text[span.start : span.end]
        with self._lock:
            for rule in self._by_where.get(where, ()):
                m = rule.regex.search(text)
                if m is not None and m.start(1) == span.start:
                    rule.seen += 1
                    rule.last_seen = now
                    h = hash(value)
                    if h != rule.value_hash:
                        rule.changes += 1
                        rule.value_hash = h
                        rule.example = self._example(value)
                    return

    # -- learning (real requests only) ---------------------------------------------------
    def observe(self, where: str, stable: str, commit: bool = True) -> list[DiscoveredRule]:
        """Compare ``stable`` (the text with known-volatile spans masked) with the last one here.

        Returns the rules discovered now (the caller re-plans this request with them).
        ``commit=False`` (explain's dry run): the same answer, nothing stored.
        """
        now = self.clock()
        text_hash = hash(stable)
        with self._lock:
            slot = self._slots.get(where)
            if slot is not None and slot.text_hash == text_hash and slot.length == len(stable):
                if commit:
                    slot.last_seen = now
                    self._slots.move_to_end(where)
                return []
            if slot is None or now - slot.last_seen > self.expire_s:
                if commit:
                    chunks = self._chunks(stable)
                    self._slots[where] = _Slot(len(stable), text_hash, chunks, last_seen=now)
                    self._trim(now)
                return []
            chunks = self._chunks(stable)
            first = next((i for i, (a, b) in enumerate(zip(chunks, slot.chunks, strict=False)) if a != b), None)
            if first is None:
                first = min(len(chunks), len(slot.chunks))  # one text is a prefix of the other
            at = first * CHUNK
            found: list[DiscoveredRule] = []
            if slot.excerpt and slot.excerpt_at <= at < slot.excerpt_at + len(slot.excerpt):
                found = self._learn(where, stable, slot, now)
            if not commit:
                return found
            self._slots.move_to_end(where)
            for rule in found:
                self._rules[(rule.where, rule.left)] = rule
                self._by_where.setdefault(where, []).append(rule)
            if found:
                self.warmup_misses += slot.kept
                slot.kept = 0
                self._trim(now)
            else:
                slot.kept += 1
            lo = max(0, at - _MARGIN)
            slot.excerpt = "" if found else stable[lo : at + CHUNK + _AFTER]
            slot.excerpt_at = lo
            slot.length, slot.text_hash, slot.chunks, slot.last_seen = len(stable), text_hash, chunks, now
            return found

    @staticmethod
    def _chunks(stable: str) -> list[int]:
        return [hash(stable[i : i + CHUNK]) for i in range(0, len(stable), CHUNK)]

    def _learn(self, where: str, stable: str, slot: _Slot, now: float) -> list[DiscoveredRule]:
        """Walk the excerpt and the current text together; each place they part is a value.

        After a value, both sides resume right after it (its length may differ), so several
        values close together (a date and an id on one line) are learned at once.
        """
        excerpt, lo = slot.excerpt, slot.excerpt_at
        ie, ic = 0, lo
        n = len(stable)
        found: list[DiscoveredRule] = []
        previous_end = 0
        for values in range(_MAX_PER_EXCERPT + 1):
            while ie < len(excerpt) and ic < n and excerpt[ie] == stable[ic]:
                ie += 1
                ic += 1
            if ie >= len(excerpt) or ic >= n:
                return found  # every difference in the excerpt was a value
            start, end = expand_value(stable, ic)
            _ex_start, ex_end = expand_value(excerpt, ie)
            if values == _MAX_PER_EXCERPT or end <= start or (ex_end <= ie and end <= ic):
                return []  # the texts part ways outside a value: another template, not a volatile one
            value = stable[start:end]
            if not _is_value(value) or not _is_value(excerpt[_ex_start:ex_end]):
                return []  # a word differs (another tenant's text): nothing here is a value
            rule = self._candidate(where, stable, start, end, previous_end, now)
            if rule is not None and all(r.left != rule.left for r in found):
                found.append(rule)
            previous_end = end
            ie, ic = max(ex_end, ie + 1), max(end, ic + 1)
        return []

    def _candidate(
        self, where: str, stable: str, start: int, end: int, previous_end: int, now: float
    ) -> DiscoveredRule | None:
        value = stable[start:end]
        left = stable[max(previous_end, start - _CONTEXT) : start]
        left = left[left.rfind(MASK) + 1 :]
        at_start = len(left) == start  # the value sits near the start of the text: anchor there
        if len(left) < _MIN_CONTEXT and not at_start:
            return None
        pattern = suggest_pattern(value)
        regex = re.compile(("\\A" if at_start else "") + re.escape(left) + "(" + pattern + ")")
        m = regex.search(stable, max(0, start - len(left)))
        if m is None or m.start(1) != start or (where, left) in self._rules:
            return None
        return DiscoveredRule(
            where, left, regex, pattern, digest(left), self._example(value), hash(value), last_seen=now
        )

    def _example(self, value: str) -> str:
        return value[:64] if self.raw_examples else shape(value)

    def _trim(self, now: float) -> None:
        while len(self._slots) > _MAX_SLOTS:
            self._slots.popitem(last=False)
        expired = [k for k, r in self._rules.items() if now - r.last_seen > self.expire_s]
        while len(self._rules) - len(expired) > self.max_rules:
            expired.append(next(k for k in self._rules if k not in expired))
        for key in expired:
            rule = self._rules.pop(key)
            self._by_where[rule.where].remove(rule)
            if not self._by_where[rule.where]:
                del self._by_where[rule.where]

    def rules(self) -> list[DiscoveredRule]:
        with self._lock:
            return list(self._rules.values())
