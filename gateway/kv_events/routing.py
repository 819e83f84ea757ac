"""Precise matching at the prefix policy's matching point.

For each eligible replica in **precise** mode (its feed is live and its events' block size
is the route's) the policy's "how much of this prompt does it hold" comes from what its
engine reported (:class:`~gateway.kv_events.index.PreciseIndex`) instead of the affinity
index's model; replicas in approximate mode are matched by the model as before.  On top of
the engine's word, per precise replica:

- **speculative records**: a choice counts as held for ``speculative_s`` (10 s) — the
  engine reports blocks only once it computed them, so a burst behind a new prefix, or a
  conversation's quick next turn, would otherwise scatter before the events arrive.  With
  the projection on, a request still in flight counts for as long as it is
  (:meth:`PreciseRouting._in_flight`).  Every
  ``_SPEC_STRIDE``-th key of the choice and its deepest are kept (bounded, expiring).
- **past the token window**: requests key text chunks there, which no event can name.  A
  replica whose engine holds the request's whole token window is credited with the deeper
  text keys the affinity index recorded for it (the engine's word up to the window, the
  model's past it), at chunk resolution: the model keeps every 4th key, so its depth is
  extended by up to 3 more of the text keys chosen for the replica
  (:class:`~gateway.kv_events.text_tail.TextTail`).  The *prediction* there is bounded by the
  deepest chain the engine still holds under the window (:meth:`PreciseRouting.held_tokens`).

The affinity index keeps recording every choice, so a replica whose events stop falls back
to a warm model.  What the policy calls: :meth:`PreciseRouting.match_groups`,
:meth:`~PreciseRouting.chose`, :meth:`~PreciseRouting.withdraw`, :meth:`~PreciseRouting.mode_of`.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from gateway.kv_events.ingest import Ingestor
from gateway.kv_events.text_tail import TextTail
from gateway.routing.affinity import AffinityIndex
from gateway.routing.base import RequestView
from gateway.routing.policies.prefix_keys import token_blocks

_SPEC_STRIDE = 8  # speculative records keep every 8th key (and the deepest): matches within 7 blocks
_SPEC_MAX_KEYS = 500_000  # (key, replica) speculative entries at most (~50 MB); the oldest choices go first
_KEYS_PER_ENTRY = 12  # a choice's full key chain (8 bytes a key) counts against that bound as 1 entry per 12 keys
_PINNED_TTL_S = 600.0  # a request in flight counts as pinning its blocks at most this long
_COMPACT_MIN = 1024  # Pinned: ended requests' entries the expiry queue may keep before a compaction
_K = TypeVar("_K")  # a counted key (_count_down)
_MODES_EVERY_S = 0.1  # the set of precise replicas is recomputed this often (its staleness is seconds)


def _kept(keys: Sequence[int]) -> tuple[int, ...]:
    """The keys a choice is remembered by: every ``_SPEC_STRIDE``-th and the deepest."""
    return (*keys[_SPEC_STRIDE - 1 :: _SPEC_STRIDE], keys[-1])


@dataclass(slots=True, eq=False)
class _Choice:
    """One routing choice held speculatively until its engine reports the blocks (or it expires)."""

    name: str
    expiry: float
    stored: tuple[int, ...]
    confirm: int | None  # the key whose BlockStored from this replica ends the speculation
    chain: Sequence[int] = ()  # every key of the choice, 8 bytes each: a match's exact depth (Speculative.depths)
    live: bool = True

    @property
    def chain_weight(self) -> int:
        """What its packed chain counts against ``_SPEC_MAX_KEYS`` (its indexed keys count one each)."""
        return len(self.chain) // _KEYS_PER_ENTRY


def _chain(keys: Sequence[int]) -> Sequence[int]:
    """``keys`` packed 8 bytes a key (the gateway's are unsigned 64-bit; anything else as a tuple)."""
    try:
        return array("Q", keys)
    except (OverflowError, TypeError):
        return tuple(keys)


class Speculative:
    """Recent choices, held until the engine confirms them or ``ttl_s`` passes: key → {replica: choice}.

    A choice ends as soon as its replica's engine reports storing its deepest token block in
    the index's reach (:meth:`confirm`): from then on the engine's word (which also tells of
    evictions) replaces it.  ``ttl_s`` bounds a choice whose events never come.

    Only every ``_SPEC_STRIDE``-th key (and the deepest) is indexed, but each choice keeps its
    whole chain packed, so a match found at a strided key is followed to where the two
    prompts part: exact to the block.  At the stride alone, every request of a batch that
    shares a document with one still queued was predicted up to 7 blocks short (tenants @
    saturated, seed 1: 194 of 352 requests, 0.52 % of prompt tokens); indexing every key
    instead cost ~4x the record time (~110 against ~25 us on a 256-block prompt).
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._by_key: dict[int, dict[str, _Choice]] = {}
        self._pending: dict[tuple[str, int], list[_Choice]] = {}
        self._queue: deque[_Choice] = deque()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def record(self, name: str, keys: Sequence[int], confirm: int | None = None) -> None:
        if self.ttl_s <= 0 or not keys:
            return
        now = self.clock()
        self._purge(now)
        choice = _Choice(name, now + self.ttl_s, _kept(keys), confirm, _chain(keys))
        by_key = self._by_key
        for key in choice.stored:
            holders = by_key.get(key)
            if holders is None:
                holders = by_key[key] = {}
            if name not in holders:
                self._size += 1
            holders[name] = choice
        self._size += choice.chain_weight
        if confirm is not None:
            self._pending.setdefault((name, confirm), []).append(choice)
        self._queue.append(choice)
        while self._size > _SPEC_MAX_KEYS and self._queue:
            self._drop(self._queue.popleft())

    def confirm(self, name: str, keys: Sequence[int]) -> None:
        """``name``'s engine stored blocks with these keys: choices waiting for them end."""
        pending = self._pending
        if not pending:
            return
        for key in keys:
            waiting = pending.pop((name, key), None)
            if waiting is not None:
                for choice in waiting:
                    self._drop(choice)

    def forget(self, name: str) -> None:
        """``name``'s cache was cleared (reset, restart): its pending choices say nothing now."""
        for choice in [c for c in self._queue if c.name == name]:
            self._drop(choice)

    def withdraw(self, name: str, keys: Sequence[int]) -> None:
        """The attempt failed before the replica computed anything: it holds none of it."""
        holders = self._by_key.get(keys[-1]) if keys else None
        choice = holders.get(name) if holders is not None else None
        if choice is not None:
            self._drop(choice)

    def depths(self, keys: Sequence[int], names: set[str]) -> dict[str, int]:
        """For each of ``names`` with a live record among ``keys``: the deepest such depth."""
        found: dict[str, int] = {}
        by_key = self._by_key
        if not by_key or not names:
            return found
        self._purge(self.clock())
        for i in range(len(keys) - 1, -1, -1):
            holders = by_key.get(keys[i])
            if holders is None:
                continue
            for name, choice in holders.items():
                if name in names and name not in found:
                    found[name] = _shared(choice.chain, keys, i + 1)
            if len(found) == len(names):
                break
        return found

    def _purge(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0].expiry <= now:
            self._drop(queue.popleft())

    def _drop(self, choice: _Choice) -> None:
        if not choice.live:
            return
        choice.live = False
        self._size -= choice.chain_weight
        by_key, name = self._by_key, choice.name
        for key in choice.stored:
            holders = by_key.get(key)
            if holders is not None and holders.get(name) is choice:
                del holders[name]
                self._size -= 1
                if not holders:
                    del by_key[key]
        if choice.confirm is not None:
            waiting = self._pending.get((name, choice.confirm))
            if waiting is not None:
                if choice in waiting:
                    waiting.remove(choice)
                if not waiting:
                    del self._pending[(name, choice.confirm)]


def _shared(chain: Sequence[int], keys: Sequence[int], depth: int) -> int:
    """How deep ``keys`` and a recorded ``chain`` agree, given they agree to ``depth`` (chained
    keys: equal at a position means equal before it); at most ``_SPEC_STRIDE - 1`` further, where
    the next indexed key would have matched."""
    end = min(len(chain), len(keys), depth + _SPEC_STRIDE - 1)
    while depth < end and chain[depth] == keys[depth]:
        depth += 1
    return depth


def _count_down(counts: dict[_K, int], key: _K) -> None:
    """One fewer of ``key`` in ``counts``; gone at 0."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


class Pinned:
    """Requests in flight per replica, by their token keys: their blocks are pinned there.

    A running request's blocks are not in its engine's free queue, so no allocation evicts
    them; a conversation's next turn that arrives while its last turn still runs finds them
    all.  Every ``_SPEC_STRIDE``-th key and the deepest are kept (a request's pinned depth is
    exact to 7 blocks below), from the choice to the request's end (``finished``,
    ``withdraw``), or ``ttl_s`` for one whose end the gateway never hears of.

    The expiry queue keeps a request's entry after it ended (emptied, in place) until the
    queue is compacted: once more than half of it is ended requests (and at least
    ``_COMPACT_MIN``), it is rebuilt without them.  Left to their ``ttl_s`` (600 s), the ended
    entries were every request of the last ten minutes: ~220 bytes each, 160 MB at 1,200
    requests/s, the gateway's RSS growing for ten minutes under a steady load (bench_soak.py).
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._keys: dict[str, dict[int, int]] = {}  # replica -> key -> requests pinning it
        self._queue: deque[tuple[float, str, list[int]]] = deque()  # (expiry, replica, its kept keys)
        self._by_end: dict[tuple[str, int], list[list[int]]] = {}  # (replica, deepest key) -> kept keys
        self._first: dict[int, dict[str, int]] = {}  # a request's first kept key -> replica -> requests
        self._ended = 0  # entries of the queue whose request ended (emptied): compacted away in bulk

    def pin(self, name: str, keys: Sequence[int]) -> None:
        if not keys:
            return
        self._purge()
        kept = list(_kept(keys))  # cleared when released (the queue holds the same list)
        held = self._keys.get(name)
        if held is None:
            held = self._keys[name] = {}
        for key in kept:
            held[key] = held.get(key, 0) + 1
        first = self._first.get(kept[0])
        if first is None:
            first = self._first[kept[0]] = {}
        first[name] = first.get(name, 0) + 1
        self._by_end.setdefault((name, keys[-1]), []).append(kept)
        self._queue.append((self.clock() + self.ttl_s, name, kept))

    def unpin(self, name: str, keys: Sequence[int]) -> None:
        """The request with these keys ended on ``name`` (one of its twins, if several run)."""
        if not keys:
            return
        twins = self._by_end.get((name, keys[-1]))
        if twins:
            self._release(name, twins.pop())
            if not twins:
                del self._by_end[(name, keys[-1])]
            self._ended += 1
            self._compact()

    def depth(self, name: str, keys: Sequence[int], low: int, high: int) -> int:
        """The deepest of ``keys[low:high]`` (1-based depth) a request in flight on ``name`` pins; ``low`` if none."""
        held = self._keys.get(name)
        if held:
            for i in range(high - 1, low - 1, -1):
                if keys[i] in held:
                    return i + 1
        return low

    def sharing(self, names: Container[str], keys: Sequence[int], high: int) -> list[str]:
        """Those of ``names`` where a request in flight may share ``keys[:high]`` from its
        first strided key on (or all of it, when shorter): one lookup, however large the
        fleet, before :meth:`shared` is asked of each."""
        first = self._first.get(keys[min(high, _SPEC_STRIDE) - 1]) if high > 0 else None
        return [name for name in first if name in names] if first else []

    def shared(self, name: str, keys: Sequence[int], low: int, high: int) -> int:
        """How deep (1-based, at least ``low``) a request in flight on ``name`` shares
        ``keys[:high]``: exact where it shares all of them, else to ``_SPEC_STRIDE - 1``
        blocks below.  O(log high): a request pins every strided key of its chain, so the
        strided keys pinned among ``keys`` are a leading run, found by bisection."""
        held = self._keys.get(name)
        if not held or high <= low:
            return low
        if keys[high - 1] in held:
            return high
        if high <= _SPEC_STRIDE or keys[_SPEC_STRIDE - 1] not in held:
            return low  # nothing in flight there shares its first strided key (the usual answer)
        lo, hi = 1, (high - 1) // _SPEC_STRIDE  # strided keys k * stride - 1 below high - 1: 1..hi
        while lo < hi:  # the most of them pinned
            mid = (lo + hi + 1) // 2
            if keys[mid * _SPEC_STRIDE - 1] in held:
                lo = mid
            else:
                hi = mid - 1
        return max(low, lo * _SPEC_STRIDE)

    def forget(self, name: str) -> None:
        """``name``'s engine lost its cache (a reset, a restart, which ends what runs there):
        its pins stand for nothing it holds or will compute for certain.  Rare: one pass."""
        self._keys.pop(name, None)
        for key in [key for key, names in self._first.items() if name in names]:
            del self._first[key][name]
            if not self._first[key]:
                del self._first[key]
        for end in [end for end in self._by_end if end[0] == name]:
            for kept in self._by_end.pop(end):
                kept.clear()  # the queue's reference sees it released
                self._ended += 1
        self._compact()

    def _release(self, name: str, kept: list[int]) -> None:
        if not kept:
            return  # released already (it ended, then its ttl passed)
        first = self._first.get(kept[0])
        if first is not None:
            _count_down(first, name)
            if not first:
                del self._first[kept[0]]
        held = self._keys.get(name)
        if held is not None:
            for key in kept:
                _count_down(held, key)
        kept.clear()  # the queue's reference sees it released

    def _compact(self) -> None:
        """Drop the ended requests' entries once they are most of the queue (amortized O(1))."""
        if self._ended >= _COMPACT_MIN and 2 * self._ended > len(self._queue):
            self._queue = deque(entry for entry in self._queue if entry[2])
            self._ended = 0

    def _purge(self) -> None:
        now, queue = self.clock(), self._queue
        while queue and queue[0][0] <= now:
            _, name, kept = queue.popleft()
            if not kept:
                self._ended -= 1
            else:  # never ended: its end is not coming
                end = kept[-1]
                self._release(name, kept)
                twins = self._by_end.get((name, end))
                if twins is not None:
                    twins[:] = [twin for twin in twins if twin]
                    if not twins:
                        del self._by_end[(name, end)]


class PreciseRouting:
    """The policy's view of the precise index: which replicas are precise, and their matches."""

    def __init__(
        self,
        ingestor: Ingestor,
        stale_s: float,
        speculative_s: float,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool = True,
        project: bool = False,
    ) -> None:
        self.ingestor = ingestor
        self.index = ingestor.index
        self.stale_s = stale_s
        self.clock = clock
        self.enabled = enabled
        self.project = project  # discount by the queued work's evictions (experimental, see _projected)
        self.index.track_lru = project or self.index.track_lru
        self.speculative = Speculative(speculative_s, clock)
        self.pinned = Pinned(_PINNED_TTL_S, clock)
        # the last match: its request, the projection's depths, the engines' depths below the floor,
        # and what they hold past the window at most (held_tokens)
        self._last: tuple[RequestView | None, dict[str, int], dict[str, int], dict[str, int]] = (None, {}, {}, {})
        self.text_tail = TextTail()  # every text key chosen per replica: past the window
        self.index.on_stored = self.speculative.confirm  # the engine's word ends a speculation
        self.index.on_cleared = self._cleared
        # hears of each replica whose engine lost its cache (the gateway clears the routes'
        # models of it: a replica that falls back to the model must not find the old belief)
        self.on_lost: Callable[[str], None] | None = None
        self._modes_at = -1.0
        self._modes_epoch = -1  # the ingestor's modes_epoch when the live set was last computed
        self._live: frozenset[str] = frozenset()
        self._version = 0
        self._masks: dict[tuple[int, int, int, int, int], tuple[int, dict[int, str]]] = {}
        # (affinity index, its generation, live version, index generation, affinity mask) -> the
        # names and the precise index's mask
        self._eligible: dict[tuple[int, int, int, int, int], tuple[set[str], int]] = {}

    def _cleared(self, name: str, lost: bool = True) -> None:
        """``name``'s entries were dropped: what it was chosen for says nothing now.  ``lost``:
        its engine cleared its cache (reset, restart), which the routes' models are told too."""
        self.speculative.forget(name)
        self.pinned.forget(name)
        self.text_tail.forget(name)
        self._modes_at = -1.0  # a clear often comes with a new stream: the modes are looked at again
        if lost and self.on_lost is not None:
            self.on_lost(name)

    # -- modes -------------------------------------------------------------------------------
    def live(self) -> frozenset[str]:
        """Replicas whose feed is live now (recomputed every ``_MODES_EVERY_S``, and at once
        after a feed was first heard or resubscribed)."""
        now = self.clock()
        epoch = self.ingestor.modes_epoch
        if now - self._modes_at >= _MODES_EVERY_S or epoch != self._modes_epoch:
            self._modes_epoch = epoch
            live = frozenset(
                name for name, feed in self.ingestor.feeds.items() if feed.mode(now, self.stale_s)[0] == "precise"
            )
            if live != self._live:
                self._live = live
                self._version += 1
                self._masks.clear()
                self._eligible.clear()
            self._modes_at = now
        return self._live if self.enabled else frozenset()

    def mode_of(self, name: str, block_size: int | None = None) -> tuple[str, str | None]:
        """("precise", None) or ("approximate", why) for ``name`` on a route hashing ``block_size``."""
        if not self.enabled:
            return "approximate", "disabled"
        feed = self.ingestor.feeds.get(name)
        if feed is None:
            return "approximate", "not_subscribed"
        mode, reason = feed.mode(self.clock(), self.stale_s)
        if mode == "precise" and block_size and self.index.keyed_size(name) not in (None, block_size):
            return "approximate", "block_size_mismatch"
        return mode, reason

    def key_route(self, route: str, block_size: int, names: Iterable[str]) -> None:
        """``route`` hashes ``block_size``-token blocks over replicas ``names``: key their
        engines' blocks at that size where theirs is a multiple of it (``PreciseIndex.key_at``),
        so a replica at a larger block size is matched from its events too."""
        self.index.key_route(route, block_size, names)

    def _precise_mask(self, affinity: AffinityIndex, block_size: int) -> tuple[int, dict[int, str]]:
        """The affinity bits of the precise replicas for this block size, and bit → name."""
        live = self.live()
        cache_key = (id(affinity), affinity.generation, self._version, self.index.keying, block_size)
        cached = self._masks.get(cache_key)
        if cached is not None:
            return cached
        mask, names = 0, {}
        for name in live:
            slot = affinity.slot_of(name)
            if slot is None or self.index.keyed_size(name) not in (None, block_size):
                continue
            mask |= 1 << slot
            names[slot] = name
        if len(self._masks) > 64:
            self._masks.clear()
        self._masks[cache_key] = (mask, names)
        return mask, names

    # -- matching ----------------------------------------------------------------------------
    def match_groups(
        self,
        affinity: AffinityIndex,
        request: RequestView,
        want: int,
        pending: Callable[[str], int] | None = None,
    ) -> list[tuple[int, int]] | None:
        """What ``affinity.match_groups(keys, want)`` answers, with the precise replicas'
        depths from their engines, and the approximate ones' past the window at the text
        tail's resolution (:meth:`_past_window`); None when neither applies (no eligible
        replica is precise and the prompt ends inside the window: the caller asks the
        affinity index as before).  ``pending(name)``: the uncached prompt tokens queued
        ahead on ``name`` (the projection, see :meth:`_projected`)."""
        keys = request.block_keys
        if not keys:
            return None
        pmask, bit_names = self._precise_mask(affinity, request.block_size or 0)
        pmask &= want
        blocks = token_blocks(request)
        if not pmask and len(keys) <= blocks:
            return None
        by_depth: dict[int, int] = {}
        approx = want & ~pmask
        if approx:
            for depth, mask in affinity.match_groups(keys, approx):
                for deeper, members in self._past_window(affinity, keys, blocks, depth, mask):
                    by_depth[deeper] = by_depth.get(deeper, 0) | members
        if not pmask:
            self._last = (request, {}, {}, {})
            return sorted(by_depth.items(), key=lambda group: -group[0])
        cache_key = (id(affinity), affinity.generation, self._version, self.index.generation, pmask)
        eligible = self._eligible.get(cache_key)
        if eligible is None:
            names = {name for slot, name in bit_names.items() if pmask >> slot & 1}
            eligible = self._eligible[cache_key] = (names, self.index.mask_of(names))
            if len(self._eligible) > 256:
                self._eligible.clear()
        names, index_mask = eligible
        depth_of = self.index.leading(keys[:blocks], mask=index_mask) if blocks else {}
        expected: dict[str, int] = {}
        if self.project and pending is not None and depth_of:
            expected = self._projected(affinity, keys, depth_of, pending, request.block_size or 1)
        for name, depth in self.speculative.depths(keys, names).items():
            if depth > depth_of.get(name, 0):
                depth_of[name] = depth
                # the request chosen there computes the blocks (again) before this one runs, and
                # pins them while it runs: what the projection gave up of the engine's word stays
                expected.pop(name, None)
        if self.project and blocks and self.speculative.ttl_s > 0:
            self._in_flight(affinity, keys, blocks, names, depth_of, expected, pending)
        limits: dict[str, int] = {}
        if len(keys) > blocks:
            whole = [name for name, depth in depth_of.items() if depth >= blocks]
            if whole:
                modelled = affinity.match(keys, whole)
                most = affinity.stride - 1  # the model's resolution: its deepest stride key held
                limits = self._past_limits(request, whole, blocks)
                for name in whole:
                    depth = max(modelled.get(name, 0), blocks)
                    if most:
                        depth = self.text_tail.extend(name, keys, depth, most)
                    if depth > blocks:
                        depth_of[name] = max(depth_of[name], depth)
        # A match shorter than the model's resolution (``stride`` blocks), unless it is the whole
        # request, routes as none: it is what nearly every prompt shares (the chat template's
        # preamble, a date line), which the model never sees.  Ranked as a match, 48 tokens pulled
        # new conversations to busy replicas and made every start look like one behind a shared
        # head (the start and work-balance rules then copied real heads: agent_toolloop lost
        # 0.6 points).  The prediction still counts it (:meth:`expected_depth` of depth 0).
        floor = min(affinity.stride, len(keys))
        shallow: dict[str, int] = {}
        for name, depth in depth_of.items():
            if depth >= floor:
                bit = 1 << affinity.slot_of(name)  # type: ignore[operator]  # in pmask: a member
                by_depth[depth] = by_depth.get(depth, 0) | bit
            elif depth > 0:
                shallow[name] = depth
        self._last = (request, expected, shallow, limits)
        return sorted(by_depth.items(), key=lambda group: -group[0])

    def _in_flight(
        self,
        affinity: AffinityIndex,
        keys: Sequence[int],
        blocks: int,
        names: set[str],
        depth_of: dict[str, int],
        expected: dict[str, int],
        pending: Callable[[str], int] | None,
    ) -> None:
        """Credit each of ``names`` with what a request in flight there shares of the window
        (:class:`Pinned`), where that is more than its engine holds and its speculative record
        says.  That request computes those blocks before this one runs: it waits ahead of it
        in the engine's queue (the engine schedules in order), or runs, or was preempted
        (vLLM frees a preempted request's blocks, which the engine may then evict, and puts
        it back at the head of its queue to compute them again).

        The speculative record says the same for ``speculative_s`` (10 s) after a choice, and
        only until the engine stores the blocks.  Measured (bench_virtual.py, Mooncake
        synthetic trace at saturation, samples 5-6): two requests made 0.66 and 0.67 points
        of prediction error, predicted 1-2k cached tokens where the engine reported 39k and
        56k: the request ahead of each with the same head had waited longer than that, or
        had been preempted after it stored its blocks.

        Only with speculative records on (``speculative_s`` 0: only what the engine reported),
        and not where more prefill than the whole cache is queued there: the request in
        flight runs and ends long before this one, and the queue cycles the cache after it
        (as a pin does not save a held prefix then, :meth:`_projected`)."""
        pinned = self.pinned
        for name in pinned.sharing(names, keys, blocks):
            have = depth_of.get(name, 0)
            if have >= blocks:
                continue
            deeper = pinned.shared(name, keys, have, blocks)
            if deeper <= have:
                continue
            if pending is not None:
                capacity = affinity.token_capacity(name)
                if capacity is not None and pending(name) >= capacity:
                    continue
            depth_of[name] = deeper
            expected.pop(name, None)  # what it computes stays while it runs

    def _past_limits(self, request: RequestView, names: list[str], blocks: int) -> dict[str, int]:
        """For each of ``names`` (holding the request's whole window): the prompt tokens its
        engine holds at most, past the window along its deepest chain there (its events tell)."""
        size = request.block_size or 1
        if not self.project or blocks * size != self.index.max_depth_tokens:
            # the route's window ends short of the index's reach (nothing past it is kept there), or
            # requests in flight are not pinned (project off): one sharing the window would be missed
            return {}
        keys = request.block_keys
        anchor = keys[blocks - 1]
        limits: dict[str, int] = {}
        for name in names:
            if self.pinned.depth(name, keys, blocks - 1, blocks) >= blocks:
                continue  # a request in flight there shares the window: what it computes past it is not stored yet
            reach = self.index.reach_past(name, anchor)
            if reach is not None:
                limits[name] = (blocks + reach) * size
        return limits

    def held_tokens(self, name: str, request: RequestView) -> int | None:
        """The most prompt tokens of ``request`` that ``name``'s engine holds now, where its
        events bound what the records credit past the window (None: no bound known)."""
        matched, _, _, limits = self._last
        return limits.get(name) if matched is request else None

    def _past_window(
        self, affinity: AffinityIndex, keys: Sequence[int], blocks: int, depth: int, mask: int
    ) -> list[tuple[int, int]]:
        """An approximate group's depth past the token window at the text tail's resolution.

        Replicas routed by the model (no events yet, a feed gone quiet) match past the window
        at its stride: up to ``stride - 1`` text chunks short of what the gateway sent them.
        The text tail recorded every one of those choices, so it refines their depth as it
        does a precise replica's (the model's depth is the start, so what the model evicted
        stays evicted).  Measured (tenants @ saturated, quick, seeds 0-2): the first
        requests of a burst reach replicas before any of their events, and the model's
        stride cost 0.24-0.40 % of prompt tokens in under-prediction, most of that cell's error."""
        most = affinity.stride - 1
        if not most or depth < blocks or len(keys) <= blocks:
            return [(depth, mask)]
        out: dict[int, int] = {}
        rest = mask
        while rest:
            bit = rest & -rest
            rest ^= bit
            deeper = self.text_tail.extend(affinity.name_of(bit.bit_length() - 1), keys, depth, most)
            out[deeper] = out.get(deeper, 0) | bit
        return list(out.items())

    def _projected(
        self,
        affinity: AffinityIndex,
        keys: Sequence[int],
        depth_of: dict[str, int],
        pending: Callable[[str], int],
        block_size: int,
    ) -> dict[str, int]:
        """Each engine's held depth as it will be when this request runs, where that is less
        than it holds now: name -> depth (in keys).

        At decision time an engine still holds blocks that the work queued ahead of this
        request there (its uncached prompt tokens, which the gateway counts) will evict
        first: at saturation, seconds of prefill.  Read as is, its word over-predicts.  So
        its state is projected forward on its own LRU order (:meth:`PreciseIndex.surviving`,
        with the age at which it evicts now, or the replica's cache size before it evicted
        anything), and what a request in flight there pins survives (:class:`Pinned`) unless
        more than the whole cache is queued ahead.

        The two forward views converge instead of one replacing the other: a block counts as
        gone only where the projection *and* the affinity model (which recorded the queued
        choices already and evicted from its own token LRU) both expect it gone.  Each alone
        misfires where the other does not: the projection's future allocations are the
        gateway's estimate (the prefill of a request already running is counted again), so
        alone it gave up blocks the engine kept (at moderate load: 2.1 % prediction error
        against 0.3 %); the model alone cannot see that the engine kept what it evicted.  The
        engine's word stays the upper bound (resets, restarts, evictions the model missed).

        The projection is the *prediction* (:meth:`expected_depth`), not the match routing
        ranks replicas by: the engine's word stays that.  Where the engine keeps what the
        projection gives up (it is an estimate of future allocations), the replica holding
        it now is still the best bet, and the request finds it there; ranking by the
        projection moved conversations off replicas that kept their history (measured:
        benchmarks/README.md).
        """
        index = self.index
        expected: dict[str, int] = {}
        for name, depth in depth_of.items():
            capacity = affinity.token_capacity(name)
            ahead = pending(name)
            if capacity is None or ahead <= 0 or depth <= 0:
                continue
            left = index.surviving(name, keys, depth, -(-ahead // block_size), capacity // block_size)
            # What a request in flight there pins stays — unless more work than the whole cache is
            # queued ahead: the pinning request finishes long before this one runs, and the queue
            # cycles the cache after it (tight KV, seed 0: the pins kept 14 of 36 predictions whole
            # that the engine had evicted)
            if left < depth and ahead < capacity:
                left = self.pinned.depth(name, keys, left, depth)
            if left < depth:  # ... and what the model, which ran the queued work already, still holds
                slot = affinity.slot_of(name)
                if slot is not None:
                    left = max(left, affinity.match(keys[:depth], None, 1 << slot).get(name, 0))
            if left < depth:
                expected[name] = left
        return expected

    def expected_depth(self, name: str, request: RequestView, depth: int) -> int:
        """The depth (in keys) of ``request`` that ``name`` will still hold when it runs there,
        ``depth`` being what :meth:`match_groups` matched (the engine's word now, and past the
        window the model's); less only where the projection expects evictions first.  A
        replica matched as holding none of it (``depth`` 0) still has what its engine holds
        below the floor :meth:`match_groups` routes by."""
        matched, expected, shallow, _ = self._last
        if matched is not request:
            return depth
        if depth == 0:
            return shallow.get(name, 0)
        left = expected.get(name)
        return depth if left is None else min(depth, left)

    def fork_tokens(self, name: str, request: RequestView, depth: int) -> int:
        """Prompt tokens ``name`` holds of ``request`` past its first ``depth`` keys' end: where
        the match stops at a text chunk (past the window: the engine holding all of it, or
        the model and the text tail on a replica routed approximately), the prompt may still
        share the start of the next chunk with the one recorded after the last key held there
        (:meth:`TextTail.fork`).  0 where none is known (no prints, a match inside the window,
        whose blocks the engine names itself)."""
        forks = request.key_forks
        if forks is None or depth <= 0:
            return 0
        index = depth - token_blocks(request)  # the text key whose chunk the match stopped before
        if index < 0 or index >= len(forks.prints):
            return 0
        pieces = self.text_tail.fork(name, request.block_keys[depth - 1], forks.prints[index])
        # ``pieces`` agree and the next does not: the prompts part inside that one, halfway on
        # average (the lower bound would under-count every fork by half a piece, ~16 tokens)
        return forks.tokens_at(index, pieces + 0.5, request.key_tokens) if pieces else 0

    def chose(self, name: str, request: RequestView, pending_tokens: int = 0) -> None:
        """``name`` was chosen for ``request``: held speculatively, and events should follow
        if it stores a block its engine does not hold (see ``stale_s``).  The blocks of it the
        engine holds are touched as the engine will once the ``pending_tokens`` queued ahead
        there are allocated (:meth:`PreciseIndex.touch`)."""
        keys = request.block_keys
        if not keys:
            return
        blocks = token_blocks(request)
        if len(keys) > blocks:
            forks = request.key_forks
            after = keys[blocks - 1] if blocks else None
            self.text_tail.record(name, keys[blocks:], forks.prints if forks is not None else (), after)
        if self.index.keyed_size(name) not in (None, request.block_size):
            return  # its events are keyed at another size than this route's: nothing to wait for or touch
        if blocks and self.project:
            self.index.touch(name, keys[:blocks], -(-pending_tokens // max(1, request.block_size or 1)))
            self.pinned.pin(name, keys[:blocks])
        # the engine stores whole blocks of its own size: keyed finer, the last keys of a
        # prompt that ends inside one of its blocks are never stored (nor waited for); the
        # index's window is whole engine blocks wherever it keys finer (PreciseIndex._rekey)
        per = self.index.keys_per_block(name)
        whole = blocks - blocks % per
        reach = min(whole, self.index.max_depth_tokens // max(1, request.block_size or 1))
        confirm = keys[reach - 1] if reach > 0 else None
        if confirm is None or not self.index.holds(name, confirm):  # held already: nothing to wait for
            self.speculative.record(name, keys, confirm)
        feed = self.ingestor.feeds.get(name)
        if feed is not None and whole and not self.index.holds(name, keys[whole - 1]):
            feed.routed(self.clock())

    def finished(self, name: str, request: RequestView) -> None:
        """``name`` served ``request`` to its end: the engine just freed the request's blocks
        to the back of its free queue, so they are its youngest now (the store events aged
        them from when they were computed, while the request pinned them)."""
        keys = request.block_keys
        blocks = token_blocks(request)
        if blocks and self.project:
            self.index.touch(name, keys[:blocks])
            self.pinned.unpin(name, keys[:blocks])

    def withdraw(self, name: str, request: RequestView) -> None:
        """The attempt failed before an answer: the choice is no evidence of a cached prefix."""
        if request.block_keys:
            self.speculative.withdraw(name, request.block_keys)
            blocks = token_blocks(request)
            after = request.block_keys[blocks - 1] if blocks else None
            self.text_tail.withdraw(name, request.block_keys[blocks:], after)
            self.pinned.unpin(name, request.block_keys[:blocks])
