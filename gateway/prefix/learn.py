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

Several gateway processes share what they learn (``gateway.state.affinity_sync``): a new
place (with a stable hash of its first value) and a place seen to vary are announced to
the learner's sink (:class:`LearnSink`) as a stable 64-bit digest of (rule, field, context) — no prompt text leaves the
process; with a shared state secret both digests are keyed (:func:`value_digest`) — and the
peers' announcements come in through ``learn_peer``.  A process that sees a
place first with another value than a peer saw there knows at once that it varies: a
template's warm-up is paid once per fleet, not once per process.  A process that joins gets
its peers' list of varying places in their catch-up snapshot (``varying_digests``).
"""

from __future__ import annotations

import hashlib
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import xxhash

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


def place_digest(rule: str, where: str, context: str, key: bytes | None = None) -> int:
    """A place's identity as the same 64-bit number in every process (``hash()`` is salted per process).

    With ``key`` (derived from the shared state secret) a keyed BLAKE2b: see :func:`value_digest`.
    """
    data = f"{rule}\x00{where}\x00{context}".encode("utf-8", "surrogatepass")
    return _keyed(data, key) if key else xxhash.xxh64_intdigest(data)


def value_digest(value: str, key: bytes | None = None) -> int:
    """A value as the same non-zero 64-bit number in every process (0 means "varies" on the wire).

    Values at a normalization place are dates, times and short ids: an unkeyed 64-bit hash of
    one is recovered by hashing every candidate (all the dates of a year, all 6-digit ids) in
    seconds by anyone who reads the channel.  With ``key`` (the state secret's, shared by the
    fleet) the digest is a keyed BLAKE2b, which only holders of the key can compute.
    """
    data = value.encode("utf-8", "surrogatepass")
    return (_keyed(data, key) if key else xxhash.xxh64_intdigest(data)) or 1


def _keyed(data: bytes, key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, key=key[:64], digest_size=8).digest(), "little")


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
    place_id: int = 0  # place_digest(): what peers know it by, computed once

    @property
    def varies(self) -> bool:
        return self.changes > 0


class LearnSink(Protocol):
    """Hears what this process learns, to share it with other gateway processes (the state sync).

    Defined here, on the learner's side, so the normalizer never imports the state layer; the
    default :data:`NO_LEARN_SINK` tells nobody.  Called synchronously: it must queue, never wait.
    """

    def learned(self, place: int, value: int) -> None:
        """A place seen first here (``value``: its first value's digest) or newly seen to vary (0)."""


class NoLearnSink:
    """The default sink: one gateway process, nothing to tell anyone."""

    __slots__ = ()

    def learned(self, place: int, value: int) -> None:
        return None


NO_LEARN_SINK = NoLearnSink()


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
        # places other gateway processes saw vary: digest -> when last announced or used
        self._peer_varies: OrderedDict[int, float] = OrderedDict()
        # places peers have seen but not (yet) vary: digest -> the value's digest there
        self._peer_values: OrderedDict[int, int] = OrderedDict()
        # hears (place digest, first value's digest) for a new place, (place digest, 0) once it varies
        self._sink: LearnSink = NO_LEARN_SINK
        self._key: bytes | None = None  # keys the digests peers hear (attach_sink's digest_key)

    @property
    def sink(self) -> LearnSink:
        """Where this process's sightings go (:data:`NO_LEARN_SINK` when not shared)."""
        return self._sink

    def attach_sink(self, sink: LearnSink, digest_key: bytes | None = None) -> None:
        """Announce every later new place and newly varying place to ``sink`` (``NO_LEARN_SINK``: stop).

        ``digest_key`` (from the shared state secret) keys the place and value digests the
        sink hears (:func:`value_digest`); every process sharing the channel must use the same.

        A method, not a constructor argument: the route's normalizer builds its learner, and
        the state sync that shares it is built once per gateway, after the routes, and
        outlives config reloads, which rebuild them, re-attaching to each new one and detaching
        when it stops.
        """
        with self._lock:
            self._sink = sink
            if digest_key != self._key:  # places already known get the digests peers will use
                self._key = digest_key
                for (rule, where, context), place in self._places.items():
                    place.place_id = place_digest(rule, where, context, digest_key)

    def varies(self, rule: str, where: str, context: str, value: str) -> bool:
        """Would this span be moved now (its place has changed, or changes with this value)?  Pure."""
        place = self._places.get((rule, where, context))
        if place is None or self.clock() - place.last_seen > self.expire_s:
            return self._peers_heard() and self._peers_saw_vary(place_digest(rule, where, context, self._key), value)
        if place.changes > 0 or place.value_hash != hash(value):
            return True
        return self._peers_heard() and self._peers_saw_vary(place.place_id, value)

    def _peers_heard(self) -> bool:
        """Has any peer announced a place (else, one gateway process: no digest to compute)?"""
        return bool(self._peer_varies or self._peer_values)

    def _peers_saw_vary(self, place: int, value: str) -> bool:
        """Did peers see the place with digest ``place`` vary, or see another value there?"""
        at = self._peer_varies.get(place)
        if at is not None and self.clock() - at <= self.expire_s:
            return True
        theirs = self._peer_values.get(place)
        return theirs is not None and theirs != value_digest(value, self._key)

    def learn_peer(self, place: int, value: int = 0) -> None:
        """A peer saw the place with digest ``place`` vary (``value`` 0) or saw it first with the
        value whose digest is ``value``: bounded, expiring."""
        with self._lock:
            if value:
                seen = self._peer_values.get(place)
                if seen is None or seen == value:
                    self._peer_values[place] = value
                    self._peer_values.move_to_end(place)
                    while len(self._peer_values) > self.max_places:
                        self._peer_values.popitem(last=False)
                    return
                del self._peer_values[place]  # two peers saw two values there: it varies
            peers = self._peer_varies
            peers[place] = self.clock()
            peers.move_to_end(place)
            while len(peers) > self.max_places:
                peers.popitem(last=False)

    def varying_digests(self, limit: int) -> list[int]:
        """Up to ``limit`` places known to vary (here or by peers), most recently seen first."""
        now = self.clock()
        with self._lock:
            mine = [
                place.place_id
                for place in reversed(self._places.values())
                if place.changes and now - place.last_seen <= self.expire_s
            ]
            theirs = [d for d, at in reversed(self._peer_varies.items()) if now - at <= self.expire_s]
        return list(dict.fromkeys([*mine, *theirs]))[:limit]

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
            announce: int | None = None  # the value digest to announce (0: varies)
            if place is None:
                place_id = place_digest(rule, where, context, self._key)
                peers_saw = self._peers_heard() and self._peers_saw_vary(place_id, value)  # then it moves at once
                example = self._example(value)
                place = Place(rule, where, digest(context), value_hash, example, 1, int(peers_saw), now, place_id)
                self._places[key] = place
                self._evict(now)
                if self._sink is not NO_LEARN_SINK:  # the digest costs a hash: only when someone hears it
                    announce = 0 if peers_saw else value_digest(value, self._key)
            else:
                self._places.move_to_end(key)
                place.seen += 1
                place.last_seen = now
                if value_hash != place.value_hash:
                    if place.changes == 0:
                        self.warmup_misses += place.seen - 1  # sightings kept in place before we knew
                        announce = 0
                    place.changes += 1
                    place.value_hash = value_hash
                    place.example = self._example(value)
                elif place.changes == 0 and self._peers_heard() and self._peers_saw_vary(place.place_id, value):
                    place.changes = 1  # a peer saw it change: as if this process had
        if announce is not None:
            self._sink.learned(place.place_id, announce)
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
