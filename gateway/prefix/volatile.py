"""Find volatile spans (timestamps, dates, ids) in text, fast.

A volatile value early in a prompt (``Current time: 2025-03-04T05:06:07Z`` at the top of a
system prompt) makes every request's prefix different, so no replica ever gets a cache hit.
This module only *finds* such spans; :mod:`gateway.prefix.normalize` decides what to do.

Speed matters: this runs on every request, before routing.  Python's ``re`` costs about
150 ns per character for an alternation of eight detectors, far too slow for a 32 KB
system prompt.  Every built-in detector's match contains a *strong digit run*: four or more
digits, or a digit next to a letter or one of ``: / - . + _ = ,``.  So the scan is:

1. translate the text to a class string (digit → ``0``, letter → ``a``, id punctuation →
   ``:``, anything else ASCII → space, non-ASCII → ``?``) with ``bytes.translate``;
2. find strong digit runs in it with a regex that starts with a literal (C fast path);
3. run the detectors only on small windows around those runs.

Text without a strong digit run costs a few microseconds per 10 KB.  User regex rules run
over the whole scanned text (their cost is theirs).

Placeholders written by relocation (``{{volatile:rule:n}}``) and the values block it
appends (recognized by its checksum, see :func:`values_block`) are never reported as spans,
which is what makes relocation idempotent.
"""

from __future__ import annotations

import re
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.prefix.settings import DETECTORS, RegexRule

# --- placeholders and the values block (their syntax lives here so the scanner can skip them)
PLACEHOLDER_PREFIX = "{{volatile:"
PLACEHOLDER_RE = re.compile(r"\{\{volatile:([a-z][a-z0-9_]{0,31}):(\d{1,6})\}\}")
BLOCK_OPEN = "<volatile_values"  # our block opens with '<volatile_values check="<crc32 hex>">'
BLOCK_CLOSE = "</volatile_values>"
_BLOCK_TAG = re.compile(r'<volatile_values check="([0-9a-f]{8})">\n')


def placeholder(rule: str, index: int) -> str:
    """The stable text that replaces the ``index``-th (1-based) span of ``rule``."""
    return f"{{{{volatile:{rule}:{index}}}}}"


def values_block(lines: Sequence[str]) -> str:
    """Our values block: its tag carries a checksum of its lines.

    The checksum is what makes the block *ours*: a literal ``<volatile_values>`` that a user
    pasted into a prompt has none (or a wrong one), so it is plain text — its values can be
    relocated like any other — while our own block is recognized on a second pass and never
    rescanned (idempotency).
    """
    body = "\n".join(lines)
    check = zlib.crc32(body.encode("utf-8", "surrogatepass"))
    return f'<volatile_values check="{check:08x}">\n{body}\n{BLOCK_CLOSE}'


def our_blocks(text: str, end: int | None = None) -> list[tuple[int, int]]:
    """``(start, end)`` of each of *our* values blocks in ``text`` (checksum verified) starting before ``end``."""
    out: list[tuple[int, int]] = []
    stop = len(text) if end is None else end
    start = text.find(BLOCK_OPEN, 0, stop)
    while start != -1:
        m = _BLOCK_TAG.match(text, start)
        close = text.find("\n" + BLOCK_CLOSE, m.end() - 1) if m is not None else -1
        if m is not None and close != -1:
            body = text[m.end() : close]
            if f"{zlib.crc32(body.encode('utf-8', 'surrogatepass')):08x}" == m.group(1):
                block_end = close + 1 + len(BLOCK_CLOSE)
                out.append((start, block_end))
                start = text.find(BLOCK_OPEN, block_end, stop)
                continue
        start = text.find(BLOCK_OPEN, start + 1, stop)
    return out


@dataclass(frozen=True, slots=True)
class Span:
    """One volatile span ``text[start:end]`` found by ``rule``."""

    start: int
    end: int
    rule: str


# --- built-in detectors ---------------------------------------------------------------
# Lookarounds use ASCII classes, not ``\w``: ``\w`` also matches CJK characters, which would
# hide ``现在时间17:30`` (a time right after Chinese text) from every detector.
_W = r"A-Za-z0-9_"
_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
# Month names of the other common European languages (de, fr, es, it, pt, nl), any case.
_EU_MONTH = (
    r"(?i:januar|jänner|februar|märz|maerz|april|mai|juni|juli|august|september|oktober|november|dezember"
    r"|janvier|février|fevrier|mars|avril|juin|juillet|août|aout|septembre|octobre|novembre|décembre|decembre"
    r"|enero|febrero|marzo|abril|mayo|junio|julio|agosto|se?tiembre|octubre|noviembre|diciembre"
    r"|gennaio|febbraio|aprile|maggio|giugno|luglio|settembre|ottobre|dicembre"
    r"|janeiro|fevereiro|março|marco|maio|junho|julho|outubro|novembro|dezembro"
    r"|januari|februari|maart|mei|augustus)"
)
_WDAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_WEEKDAY = r"(?:(?:Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day|Mon|Tue|Tues|Wed|Thu|Thur|Thurs|Fri|Sat|Sun)\.?"
_TZ = r"(?:[+-]\d{4}|UT|UTC|GMT|Z|[ECMP][SD]T)"
_HMS = r"(?:[01]?\d|2[0-3]):[0-5]\d(?::[0-5]\d)?"
_ORD = r"(?:st|nd|rd|th)"
# CJK/Korean dates: 2025年3月4日, 2025年3月4日17:30:00, 2025年3月4日 17时30分, 2025년 3월 4일
_CJK_TIME = (
    r"(?:\s*(?:[01]?\d|2[0-3])(?::[0-5]\d(?::[0-5]\d)?"
    r"|[时時点點시]\s*(?:[0-5]?\d[分분](?:\s*[0-5]?\d[秒초])?)?))?"
)
_CJK_DATE = (
    rf"(?:19|20)\d{{2}}年\s*(?:0?[1-9]|1[0-2])月\s*(?:0?[1-9]|[12]\d|3[01])[日号]{_CJK_TIME}"
    rf"|(?:19|20)\d{{2}}년\s*(?:0?[1-9]|1[0-2])월\s*(?:0?[1-9]|[12]\d|3[01])일{_CJK_TIME}"
)

_PATTERNS: dict[str, str] = {
    # "Tue, 04 Mar 2025 05:06:07 +0000", "4 Mar 2025 05:06 GMT", and ctime/`date` style
    # "Tue Mar  4 05:06:07 UTC 2025" / "Tue Mar  4 05:06:07 2025".
    "rfc2822_datetime": (
        rf"(?<![{_W}])(?:(?:{_WDAY},?\s+)?\d{{1,2}}\s+{_MONTH}\s+\d{{4}}\s+{_HMS}(?:\s*{_TZ})?"
        rf"|{_WDAY}\s+{_MONTH}\s+\d{{1,2}}\s+{_HMS}(?:\s+[A-Z]{{2,5}})?\s+\d{{4}})(?![{_W}])"
    ),
    # "2025-03-04T05:06:07Z", "2025-03-04 05:06:07.123+01:00", "2025-03-04T05:06"
    "iso_datetime": (
        rf"(?<![{_W}.-])\d{{4}}-[01]\d-[0-3]\d[T ][0-2]\d:[0-5]\d(?::[0-5]\d(?:[.,]\d{{1,9}})?)?"
        rf"(?:\s?(?:Z|UTC|[+-][0-2]\d(?::?[0-5]\d)?))?(?![{_W}])"
    ),
    "uuid": (
        r"(?<![0-9A-Za-z-])[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}(?![0-9A-Za-z-])"
    ),
    # Seconds (10 digits) or milliseconds (13) since the epoch.  Any 10-digit number would
    # match syntactically (phone 2125551234, "Account 1000000001"), so only values within a
    # few years of now count (see _plausible_epoch) and round numbers (2000000000) never do.
    "unix_timestamp": rf"(?<![{_W}.])[1-3]\d{{9}}(?:\d{{3}}|\.\d{{1,6}})?(?![{_W}]|\.\d)",
    # "2025-03-04", "2025/03/04", "04/03/2025", "4.3.2025", "March 4, 2025", "4 March 2025",
    # "Tuesday, March 4th, 2025", "March 4th", "the 4th of March", "4. März 2025",
    # "4 de marzo de 2025", "1er mars 2025", "2025年3月4日17:30:00".  Not inside a dated name
    # such as "gpt-4o-2024-08-06" (no "-" or "." before).
    "date": (
        rf"(?<![{_W}.-])(?:(?:19|20)\d{{2}}(?P<_ds1>[-/.])(?:0?[1-9]|1[0-2])(?P=_ds1)(?:0?[1-9]|[12]\d|3[01])"
        r"|(?:[0-3]?\d)(?P<_ds2>[/-])(?:[0-3]?\d)(?P=_ds2)(?:\d{4}|\d{2})"
        r"|[0-3]?\d\.[01]?\d\.(?:19|20)\d{2}"
        rf"|(?:{_WEEKDAY},?\s+)?{_MONTH}\.?\s+[0-3]?\d{_ORD}?,?\s+(?:19|20)\d{{2}}"
        rf"|(?:{_WEEKDAY},?\s+)?[0-3]?\d{_ORD}?\s+(?:of\s+)?{_MONTH}\.?,?\s+(?:19|20)\d{{2}}"
        rf"|(?:{_WEEKDAY},?\s+)?{_MONTH}\.?\s+[0-3]?\d{_ORD}"
        rf"|[0-3]?\d{_ORD}\s+of\s+{_MONTH}"
        rf"|[0-3]?\d(?:\.|er|º|°|o)?\s+(?:(?i:de)\s+)?{_EU_MONTH}\.?,?\s+(?:(?i:de|del)\s+)?(?:19|20)\d{{2}}"
        rf"|{_CJK_DATE})(?![{_W}])"
    ),
    # "05:06", "05:06:07.123", "5:06 PM", "17:30 UTC".  Not a range ("9:00-17:00": office
    # hours) and not a bare one-digit "H:MM" ("John 3:16"): those need seconds or a suffix.
    "time": (
        rf"(?<![{_W}:.])(?<![-\u2013])(?<![-\u2013] )"
        r"(?:(?:[01]\d|2[0-3]):[0-5]\d(?::[0-5]\d)?|\d:[0-5]\d:[0-5]\d"
        r"|\d:[0-5]\d(?=[.,]\d|\s?[AaPp]\.?[Mm]|\s?(?:UTC|GMT|Z)))"
        rf"(?:[.,]\d{{1,6}})?(?:\s?[AaPp]\.?[Mm]\.?)?(?:\s?(?:UTC|GMT|Z))?"
        rf"(?![{_W}:]|\.\d|\s?[-\u2013]\s?\d)"
    ),
    # 16..128 hex digits (sha1/sha256, trace ids, long decimal ids); at least one digit.
    # A 16-digit decimal that passes the Luhn check is a card number, not an id (_not_card).
    "hex_id": r"(?<![0-9A-Za-z_])(?=[0-9a-fA-F]*[0-9])[0-9a-fA-F]{16,128}(?![0-9A-Za-z_])",
    # "req_8f3k2l9x0a", "cus_N3kd92LxQe": a short lower-case prefix, "_", then a random-looking
    # tail of 8..64 letters and digits (see _looks_random: "get_user2profile" is not random).
    "prefixed_id": r"(?<![0-9A-Za-z_])[a-z]{2,12}_(?=[A-Za-z0-9]*\d)[A-Za-z0-9]{8,64}(?![0-9A-Za-z_-])",
    # 20..200 chars of base64/base64url/ULID-ish text with a digit and a letter; see _looks_random
    # ("nonce=Zx81..." counts: "=" may precede it, it only ever ends one).
    "base64_id": (
        r"(?<![A-Za-z0-9+/_-])(?=[A-Za-z0-9+/_-]*[0-9])(?=[A-Za-z0-9+/_-]*[A-Za-z])"
        r"[A-Za-z0-9+/_-]{20,200}={0,2}(?![A-Za-z0-9+/_=-])"
    ),
}
assert tuple(_PATTERNS) == DETECTORS

# Class string for the prefilter (ASCII only; other characters are left as they are).
# Bytes, not str: ``str.translate`` takes ~8 ns/char on ASCII text and ~100 ns/char once a
# single CJK character is in it; ``encode("ascii", "replace")`` (one "?" per non-ASCII char,
# so positions are kept) plus ``bytes.translate`` is 10-20x faster on both.
_CLASS_TABLE = bytes(
    ord("0" if chr(c).isdigit() else "a" if chr(c).isalpha() else ":" if chr(c) in ":/-.+_=," else " ")
    if c < 128
    else ord("?")
    for c in range(256)
)
# A strong digit run: a digit preceded by a letter/punct, four digits, or digits then a letter/punct.
_STRONG = re.compile(rb"0(?:(?<=[:a]0)|000|0{0,3}[:a])")
_NON_ID = re.compile(rb"[^0a:]")
# How far a detector match reaches from its first strong run: to the left over a weekday and
# month name ("Wednesday, September 18th, 2025": 21 chars), to the right over the rest of a
# datetime ("2025 05:06:07.123456 +0000").  Ids are followed to their end separately.
_LEFT = 40
_RIGHT = 64
_ID_REACH = 512  # how far an id-like run is followed past the context window
_SPILL = 256  # a span may start before the scan limit and end after it


_EPOCH_YEARS = 5  # a Unix timestamp in a prompt is "now-ish": within this many years of now
_YEAR_S = 365 * 86400


def _plausible_epoch(value: str, now: float | None = None) -> bool:
    """A 10/13-digit number is read as a Unix timestamp only near now and when not round.

    Syntax alone cannot tell ``2125551234`` (a phone number) or ``1000000001`` (an account)
    from a timestamp; a prompt's "current time" is within a few years of the gateway's clock,
    and round numbers (``2000000000``) are limits and ids, not clocks.
    """
    digits = value.partition(".")[0]
    seconds = int(digits[:10])
    if digits.endswith("000000") and "." not in value:
        return False
    current = time.time() if now is None else now
    return abs(seconds - current) <= _EPOCH_YEARS * _YEAR_S


def _not_card(value: str) -> bool:
    """False for a 16-digit decimal that passes the Luhn check (a payment card number)."""
    if len(value) != 16 or not value.isdigit():
        return True
    total = 0
    for i, ch in enumerate(reversed(value)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 != 0


_VOWELS = frozenset("aeiouyAEIOUY")


def _random_tail(value: str) -> bool:
    """``req_8f3k2l9x0a``: the part after the prefix must look random.

    Random base36 often has one digit only (``req_kqzt7bxmwa``), which the class-change test
    alone misses; its letters rarely form words, though: few vowels, long consonant runs
    (``get_user2profile`` has neither).  Two digits in separate runs also count.  A static
    identifier read as an id costs nothing: only values seen to change are moved.
    """
    tail = value.partition("_")[2]
    if _looks_random(tail):
        return True
    letters = vowels = run = longest = digit_runs = 0
    previous_digit = False
    for ch in tail:
        if ch.isdigit():
            run = 0
            digit_runs += not previous_digit
            previous_digit = True
            continue
        previous_digit = False
        letters += 1
        if ch in _VOWELS:
            vowels += 1
            run = 0
        else:
            run += 1
            longest = max(longest, run)
    return digit_runs >= 2 or longest >= 4 or (letters >= 6 and vowels * 6 < letters)


#: Post-checks of a detector's match (a regex alone cannot express them).
CHECKS: dict[str, Callable[[str], bool]] = {
    "unix_timestamp": _plausible_epoch,
    "hex_id": _not_card,
    "prefixed_id": _random_tail,
}


def accept_match(rule: str, value: str) -> bool:
    """Whether a built-in detector's regex match ``value`` is kept (see :data:`CHECKS`)."""
    check = CHECKS.get(rule)
    if check is None:
        return rule != "base64_id" or _looks_random(value)
    return check(value)


_CHECKED = frozenset(CHECKS) | {"base64_id"}


def _looks_random(value: str) -> bool:
    """Tell an opaque id (``Zx81kQ0pLm...``) from a long identifier (``fetchWeatherForecastV2``).

    Random base64 changes character class (upper/lower/digit) at ~60 % of positions and
    base36/ULID text at ~40 %; camelCase or snake_case words change at word boundaries only
    and rarely hold two digits.  A heuristic: disable ``base64_id`` or add a rule if it errs.
    """
    last = 0
    changes = digits = counted = 0
    seen = 0
    for ch in value:
        if "0" <= ch <= "9":
            cls = 1
            digits += 1
        elif "A" <= ch <= "Z":
            cls = 2
        elif "a" <= ch <= "z":
            cls = 4
        else:
            continue
        if last and cls != last:
            changes += 1
        last = cls
        seen |= cls
        counted += 1
    if seen & 6 == 6:  # mixed case: base64 changes class at ~60 % of positions
        return changes >= max(4, counted * 2 // 5)
    return digits >= 2 and changes >= max(4, counted // 4)


class VolatileScanner:
    """Compiled detectors and rules for one route; :meth:`scan` is pure and thread-safe."""

    def __init__(self, detectors: Sequence[str] = DETECTORS, rules: Sequence[RegexRule] = ()) -> None:
        enabled = [d for d in DETECTORS if d in set(detectors)]
        if enabled:
            self._builtin: re.Pattern[str] | None = re.compile(
                "|".join(f"(?:{_PATTERNS[name]})(?P<{name}>)" for name in enabled)
            )
        else:
            self._builtin = None
        self._rules = [(r.name, re.compile(r.pattern, re.IGNORECASE if r.ignore_case else 0)) for r in rules]
        # A span of a user rule wins over a built-in one at the same start (rules are explicit).
        self._priority = {r.name: i for i, r in enumerate(rules)}
        self._priority.update({name: len(rules) + i for i, name in enumerate(enabled)})

    @property
    def empty(self) -> bool:
        return self._builtin is None and not self._rules

    def scan(self, text: str, limit: int | None = None) -> list[Span]:
        """Non-overlapping volatile spans starting before ``limit`` (default: whole text), in order.

        Placeholders and values blocks written by relocation are skipped.
        """
        n = len(text)
        stop = n if limit is None else min(n, limit)
        if stop <= 0:
            return []
        end = min(n, stop + _SPILL)
        protected = _protected_ranges(text, end)
        text = mask_placeholders(text)
        found: list[tuple[int, int, int, str]] = []
        if self._builtin is not None:
            self._scan_builtin(text, stop, end, found)
        for name, rx in self._rules:
            prio = self._priority[name]
            for m in rx.finditer(text, 0, end):
                if m.start() < stop and m.end() > m.start():
                    found.append((m.start(), -(m.end() - m.start()), prio, name))
        if not found:
            return []
        found.sort()
        spans: list[Span] = []
        cursor = 0
        for start, neg_len, _prio, name in found:
            stop_at = start - neg_len
            if start < cursor or _overlaps(protected, start, stop_at):
                continue
            spans.append(Span(start, stop_at, name))
            cursor = stop_at
        return spans

    def _scan_builtin(self, text: str, stop: int, end: int, found: list[tuple[int, int, int, str]]) -> None:
        cls = text[:end].encode("ascii", "replace").translate(_CLASS_TABLE)
        regions: list[list[int]] = []
        for m in _STRONG.finditer(cls, 0, stop + _LEFT):
            p = m.start()
            lo = max(0, p - _LEFT)
            hi = min(end, p + _RIGHT)
            if regions and lo <= regions[-1][1]:
                if hi > regions[-1][1]:
                    regions[-1][1] = hi
            else:
                regions.append([lo, hi])
        if not regions:
            return
        rx = self._builtin
        assert rx is not None
        priority = self._priority
        for lo, hi in regions:
            # Widen to id boundaries so an id crossing the window edge is seen whole (bounded).
            if hi < end:
                nxt = _NON_ID.search(cls, hi, min(end, hi + _ID_REACH))
                hi = nxt.start() if nxt else min(end, hi + _ID_REACH)
            if lo > 0:
                back = max(0, lo - _ID_REACH)
                cut = cls.rfind(b" ", back, lo)
                lo = cut + 1 if cut >= 0 else back
            for m in rx.finditer(text, lo, hi):
                start = m.start()
                if start >= stop:
                    break
                name = m.lastgroup
                assert name is not None
                if name in _CHECKED and not accept_match(name, m.group()):
                    continue
                found.append((start, start - m.end(), priority[name], name))
        # Regions are disjoint only before widening; duplicates are removed by the caller's sweep.


def _protected_ranges(text: str, end: int) -> list[tuple[int, int]]:
    """Placeholders and our own values block already in ``text``: never spans themselves."""
    ranges: list[tuple[int, int]] = []
    if PLACEHOLDER_PREFIX in text:
        ranges.extend(m.span() for m in PLACEHOLDER_RE.finditer(text, 0, end))
    if BLOCK_OPEN in text:
        ranges.extend(our_blocks(text, end))
    ranges.sort()
    return ranges


def _overlaps(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    for lo, hi in ranges:
        if lo >= end:
            return False
        if hi > start:
            return True
    return False


def mask_placeholders(text: str) -> str:
    """``text`` with each placeholder replaced by as many ``_`` (same positions).

    Detectors look at their neighbours (``(?<![A-Za-z0-9_.-])``): a value that directly
    followed a moved one (``...17:30:002025-03-04T05:06``) must not become a match on a
    second pass just because its neighbour is now ``}}``.  ``_`` is a word character to every
    detector, like the value the placeholder replaced.
    """
    if PLACEHOLDER_PREFIX not in text:
        return text
    return PLACEHOLDER_RE.sub(lambda m: "_" * (m.end() - m.start()), text)


def existing_placeholder_max(text: str) -> dict[str, int]:
    """Highest placeholder index per rule already present (so new ones never collide)."""
    if PLACEHOLDER_PREFIX not in text:
        return {}
    best: dict[str, int] = {}
    for m in PLACEHOLDER_RE.finditer(text):
        idx = int(m.group(2))
        if idx > best.get(m.group(1), 0):
            best[m.group(1)] = idx
    return best
