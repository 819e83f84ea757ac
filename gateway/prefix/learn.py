"""Learn, per route and online, which detected spans really vary.

Detectors are syntactic: a knowledge-cutoff date, a dated model name or a phone number look
like timestamps and ids.  Moving such a value buys nothing (it never changes, so it never
split the cache) and changes the prompt the model reads.  So a span is moved only once its
value has been seen to *change* at the same place: the same route, the same field, the same
rule and the same surrounding text (a fingerprint of up to 24 characters before and 8 after,
digits masked, clipped at neighbouring spans).  A place that never changed is "static".

Cost and memory: one dict lookup per detected span; at most ``max_places`` places per route
(least recently seen evicted first), each holding hashes, counters and a *shape* of the value
(``2025-03-04`` → ``9999-99-99``; raw text only with ``examples: raw``).  A place not seen for
``expire_s`` is forgotten.  No prompt text is kept unless the debug setting allows it.

The price is warm-up: the first request of a template keeps its (new) value in place, so it
misses; the value is moved from the first request whose value differs (the 2nd for a value
that changes every request).  Each request that kept a value before its place was known to
vary is counted in ``warmup_misses``.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass

# Digits → 9, ASCII letters → a/A: enough to show a value's format, nothing of its content.
_SHAPE = str.maketrans(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "9" * 10 + "a" * 26 + "A" * 26,
)
_MASK_DIGITS = str.maketrans("0123456789", "0000000000")
_CONTEXT_LEFT = 24
_CONTEXT_RIGHT = 8
# Characters of dates and times in CJK/Korean text: format, not content, so shapes keep them.
_FORMAT_CHARS = frozenset("年月日号时時点點分秒년월일시분초")


def shape(value: str, limit: int = 64) -> str:
    """``req_8f3k2l9x0a`` → ``aaa_9a9a9a9a9a``: the format of a value without its content."""
    out = value[:limit].translate(_SHAPE)
    if not out.isascii():
        out = "".join(ch if ch.isascii() or ch in _FORMAT_CHARS else ("a" if ch.isalpha() else "?") for ch in out)
    return out + ("…" if len(value) > limit else "")


def context_key(text: str, start: int, end: int, lo: int, hi: int) -> str:
    """The text around ``text[start:end]`` (clipped to ``[lo, hi)``), digits masked."""
    left = text[max(lo, start - _CONTEXT_LEFT) : start]
    right = text[end : min(hi, end + _CONTEXT_RIGHT)]
    return f"{left}\x00{right}".translate(_MASK_DIGITS)


def digest(text: str) -> str:
    """A short stable digest of a context (shown in stats instead of the text)."""
    return f"{zlib.crc32(text.encode('utf-8', 'surrogatepass')):08x}"


def suggest_pattern(value: str) -> str:
    """A regex for values shaped like ``value``: digit runs, letter runs, random runs, separators.

    ``2025年3月4日17:30:00`` → ``\\d{4}年\\d{1,2}月\\d{1,2}日\\d{1,2}:\\d{2}:\\d{2}``;
    ``req_8f3k2l9x0a`` → ``[a-z]{3}_[a-z0-9]{10}``.  Meant to be pinned in config as a rule.
    """
    pieces: list[str] = []
    i = 0
    n = len(value)
    while i < n:
        ch = value[i]
        if ch.isascii() and ch.isalnum():
            j = i
            while j < n and value[j].isascii() and value[j].isalnum():
                j += 1
            pieces.append(_run_pattern(value[i:j]))
            i = j
        else:
            pieces.append("\\s+" if ch.isspace() else _escape(ch))
            while i < n and ch.isspace() and value[i].isspace():
                i += 1
            if not ch.isspace():
                i += 1
    return "".join(pieces)


def _escape(ch: str) -> str:
    return "\\" + ch if ch in ".^$*+?{}[]\\|()-/" else ch


def _run_pattern(run: str) -> str:
    n = len(run)
    if run.isdigit():
        return "\\d{1,2}" if n <= 2 else f"\\d{{{n}}}"
    classes = ""
    if any(c.islower() for c in run):
        classes += "a-z"
    if any(c.isupper() for c in run):
        classes += "A-Z"
    if any(c.isdigit() for c in run):
        classes += "0-9"
    return f"[{classes}]{{{n}}}"


@dataclass(slots=True)
class Place:
    """One place where a detector (or discovery) found a value, and what its values did."""

    rule: str
    where: str
    context: str  # digest of the surrounding text
    value_hash: int
    example: str  # shape of the last value (raw text only with examples="raw")
    seen: int = 1
    changes: int = 0
    last_seen: float = 0.0

    @property
    def varies(self) -> bool:
        return self.changes > 0


class VarianceLearner:
    """Bounded, expiring map place → value history; thread-safe, O(1) per span."""

    def __init__(self, max_places: int = 4096, expire_s: float = 3600.0, raw_examples: bool = False) -> None:
        self.max_places = max_places
        self.expire_s = expire_s
        self.raw_examples = raw_examples
        self._places: OrderedDict[tuple[str, str, str], Place] = OrderedDict()
        self._lock = threading.Lock()
        self.warmup_misses = 0
        self.clock = time.monotonic

    def varies(self, rule: str, where: str, context: str, value: str) -> bool:
        """Would this span be moved now (its place has changed, or changes with this value)?  Pure."""
        place = self._places.get((rule, where, context))
        if place is None or self.clock() - place.last_seen > self.expire_s:
            return False
        return place.changes > 0 or place.value_hash != hash(value)

    def record(self, rule: str, where: str, context: str, value: str) -> bool:
        """Record one sighting; returns whether the place varies (move the span)."""
        key = (rule, where, context)
        now = self.clock()
        value_hash = hash(value)
        with self._lock:
            place = self._places.get(key)
            if place is not None and now - place.last_seen > self.expire_s:
                del self._places[key]
                place = None
            if place is None:
                self._places[key] = Place(rule, where, digest(context), value_hash, self._example(value), 1, 0, now)
                self._evict(now)
                return False
            self._places.move_to_end(key)
            place.seen += 1
            place.last_seen = now
            if value_hash != place.value_hash:
                if place.changes == 0:
                    self.warmup_misses += place.seen - 1  # sightings kept in place before we knew
                place.changes += 1
                place.value_hash = value_hash
                place.example = self._example(value)
            return place.changes > 0

    def _example(self, value: str) -> str:
        return value[:64] if self.raw_examples else shape(value)

    def _evict(self, now: float) -> None:
        places = self._places
        while len(places) > self.max_places:
            places.popitem(last=False)
        # Drop a few expired places from the old end on every insert (amortized O(1)).
        for _ in range(4):
            if not places:
                break
            key, oldest = next(iter(places.items()))
            if now - oldest.last_seen <= self.expire_s:
                break
            del places[key]

    def places(self) -> list[Place]:
        with self._lock:
            return list(self._places.values())

    def __len__(self) -> int:
        return len(self._places)
