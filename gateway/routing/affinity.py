"""Which replicas recently served which prefix: a bounded, LRU prefix-affinity index.

Keys are chained block hashes (:func:`gateway.prefix.blocks.chain_block_keys`): the key of
block *i* names the whole prefix ``tokens[: (i + 1) * block_size]``.  So "the deepest key of a
request that some replica has served" is the longest prefix that replica has computed, and
a growing conversation finds the replica holding its history by looking its keys up from the
deepest down.

Memory is bounded in bytes: each replica keeps an LRU of at most ``capacity`` keys — the
index's ``max_bytes`` (and ``max_entries``, if set) shared among replicas at a conservative
:meth:`entry_bytes` per (key, replica) pair.  :meth:`memory_bytes` measures what the
structures hold (tests check it against the bound and against ``tracemalloc``).

A replica whose KV cache size is known (:meth:`set_token_capacity`) is also modelled as the
LRU of *tokens* its cache is: each stored key weighs the prompt tokens it adds after the
stored key before it (a key every 64 tokens inside the token window, one per ~1,000 tokens
of text past it), and the oldest keys go once the replica's keys weigh more than its cache
holds.  Counting keys instead would let a 32k-token prompt weigh like 6k tokens (its text
keys are sparse), so the index would keep predicting prefixes the engine evicted long ago.
Recording a request touches its keys on the replica that serves it, shallow keys last, so —
like vLLM, which frees a finished request's blocks tail first — a replica "forgets" the
tails of old prompts before their shared heads.  Only every ``stride``-th key (and the
deepest) is stored; lookups still probe every key, so a request that extends an earlier one
always finds the earlier one's deepest key.  What a stored key weighs is
:mod:`gateway.routing.key_weights`.

Not thread-safe; the gateway runs it on one event loop.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Sequence
from itertools import pairwise

from gateway.routing.key_weights import KeyWeights, even_weights, stride_weights
from gateway.routing.sinks import NO_SINK, RecordSink

# Bytes one (key, replica) pair costs at most, with up to 30 replicas: the key's int (36),
# its share of the holders dict (<= 110 just after a resize), the replica's OrderedDict
# entry and node (<= 190 just after a resize), an extent int on deepest keys, and the key's
# next-key record (dict entry and int, <= 150).  tracemalloc: see tests/prefix/test_prefix_affinity.py.
ENTRY_BYTES = 560
# With a KV cache model, each (key, replica) pair also keeps its weight: a dict entry (<= 100
# bytes just after a resize) and, past 256 tokens, the int.
WEIGHT_BYTES = 140


_MISSING = object()

__all__ = ["ENTRY_BYTES", "WEIGHT_BYTES", "AffinityIndex", "KeyWeights"]  # KeyWeights: re-exported


def _depth_first(group: tuple[int, int]) -> int:
    return -group[0]


class AffinityIndex:
    """Prefix block key → replicas predicted to hold it (a bit mask), with per-replica LRUs."""

    def __init__(
        self,
        max_entries: int | None = None,
        stride: int = 1,
        max_bytes: int | None = None,
    ) -> None:
        if (max_entries is not None and max_entries < 1) or stride < 1:
            raise ValueError("max_entries and stride must be >= 1")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        if max_entries is None and max_bytes is None:
            raise ValueError("give max_entries or max_bytes (the index must be bounded)")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.stride = stride
        # The KV cache model (set_token_capacity): per capped replica, its cache size in tokens,
        # each stored key's weight in tokens and their sum.
        self._token_cap: dict[str, int] = {}
        self._weight: dict[str, dict[int, int]] = {}
        self._used: dict[str, int] = {}
        # The standard weight of a stored key (one stride of whole blocks), also what a key
        # weighs when the recorder cannot say (a peer's record); see default_weight.
        self._default_weight = stride
        self._holders: dict[int, int] = {}
        self._child: dict[int, int] = {}  # key -> the next stored key after it in the first prompt seen
        self._forks: set[int] = set()  # keys seen followed by two different continuations
        # per replica: key -> prompt tokens of the request that last recorded it as its deepest
        # key (the prompt ran past the window), else None
        self._lru: dict[str, OrderedDict[int, int | None]] = {}
        self._slot: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self.generation = 0  # moves whenever a slot is given or taken: masks from mask_of() expire
        self._sink: RecordSink = NO_SINK  # hears of each local record (see attach_sink)

    # -- the seam to shared state ---------------------------------------------------------
    @property
    def sink(self) -> RecordSink:
        """Where local records go (:data:`~gateway.routing.sinks.NO_SINK` when not shared)."""
        return self._sink

    def attach_sink(self, sink: RecordSink) -> None:
        """Send every later local record to ``sink`` (``NO_SINK``: stop sharing).

        A method, not a constructor argument: the index is built by its route's policy from
        the route's settings, and the state sync that shares it is built once per gateway,
        after the routes, and outlives config reloads, which rebuild routes (and their
        indexes) under it, re-attaching to each new one and detaching when it stops.  So the
        sink arrives after construction and changes during the index's life.
        """
        self._sink = sink

    # -- membership --------------------------------------------------------------------
    def set_members(self, names: Iterable[str]) -> None:
        """Track exactly ``names``: forget replicas that left, make room for new ones."""
        wanted = list(dict.fromkeys(names))
        for name in [n for n in self._lru if n not in set(wanted)]:
            self.forget(name)
        for name in wanted:
            self._ensure(name)
        self._trim_all()

    def forget(self, name: str) -> None:
        """Drop everything recorded for ``name`` (it left the pool)."""
        lru = self._lru.pop(name, None)
        slot = self._slot.pop(name, None)
        self._token_cap.pop(name, None)
        self._weight.pop(name, None)
        self._used.pop(name, None)
        if lru is None or slot is None:
            return
        bit = 1 << slot
        holders = self._holders
        for key in lru:
            mask = holders.get(key, 0) & ~bit
            if mask:
                holders[key] = mask
            else:
                holders.pop(key, None)
                self._forget_key(key)
        del self._names[slot]
        self.generation += 1

    def clear(self, name: str) -> int:
        """``name``'s engine lost its prefix cache (reset, restart): drop what the model
        believes it holds, keep it a member.  A replica that falls back to the model later
        (its KV events stop) must not find the belief its engine contradicted.  Returns the
        keys dropped.  Peers are not told: each gateway hears of the loss itself."""
        lru = self._lru.get(name)
        return len(self.withdraw(name, list(lru))) if lru else 0

    def _forget_key(self, key: int) -> None:
        """No replica holds ``key`` any more: forget what followed it."""
        self._child.pop(key, None)
        self._forks.discard(key)

    def _ensure(self, name: str) -> int:
        slot = self._slot.get(name)
        if slot is None:
            slot = next(i for i in range(len(self._names) + 1) if i not in self._names)
            self._slot[name] = slot
            self._names[slot] = name
            self.generation += 1
            self._lru[name] = OrderedDict()
        return slot

    def entry_bytes(self) -> int:
        """Bytes budgeted per (key, replica) pair: masks grow by 4 bytes per 30 replicas, and
        a modelled KV cache keeps each key's weight too."""
        return ENTRY_BYTES + 4 * (len(self._names) // 30) + (WEIGHT_BYTES if self._token_cap else 0)

    def capacity(self) -> int:
        """Keys each replica may hold (the memory bound; a KV cache model may evict sooner)."""
        replicas = max(1, len(self._lru))
        total = self.max_entries if self.max_entries is not None else sys.maxsize
        if self.max_bytes is not None:
            # The dicts' fixed overhead (two empty dicts per replica plus the holders dict).
            spare = self.max_bytes - 100 * (2 * replicas + 1)
            total = min(total, max(replicas, spare // self.entry_bytes()))
        return max(1, total // replicas)

    def set_token_capacity(self, name: str, tokens: int | None) -> None:
        """Model ``name``'s prefix cache as an LRU of ``tokens`` prompt tokens (None: stop).

        Keys recorded before the cap was known weigh :attr:`default_weight` each.
        """
        if tokens is None:
            if self._token_cap.pop(name, None) is not None:
                self._weight.pop(name, None)
                self._used.pop(name, None)
            return
        tokens = max(1, int(tokens))
        if self._token_cap.get(name) == tokens:
            return
        self._ensure(name)
        if name not in self._token_cap:  # keys held so far weigh the standard weight
            self._weight[name] = {}
            self._used[name] = self._default_weight * len(self._lru[name])
        self._token_cap[name] = tokens
        self._trim_all()

    def set_stride(self, stride: int) -> None:
        """Store every ``stride``-th key from now on (the policy's, once it knows the route's
        block size).  Keys stored before stay: a shorter stride probes every position they can
        sit at; a longer one comes with a smaller block size, whose keys hash other blocks than
        the stored ones, which age out of the LRUs."""
        if stride < 1:
            raise ValueError("stride must be >= 1")
        self.stride = stride

    @property
    def default_weight(self) -> int:
        """Tokens a stored key weighs unless its record said otherwise: one stride of blocks
        (the policy sets it once it knows the block size)."""
        return self._default_weight

    @default_weight.setter
    def default_weight(self, tokens: int) -> None:
        old, self._default_weight = self._default_weight, max(1, int(tokens))
        for name, weights in self._weight.items():  # keys without their own weight weigh the new one
            standard_keys = len(self._lru[name]) - len(weights)
            self._used[name] += (self._default_weight - old) * standard_keys
        self._trim_all()

    def token_capacity(self, name: str) -> int | None:
        """``name``'s modelled cache size in tokens (None: not modelled)."""
        return self._token_cap.get(name)

    def tokens_held(self, name: str) -> int | None:
        """Prompt tokens ``name``'s modelled cache holds now (None: not modelled)."""
        return self._used.get(name) if name in self._token_cap else None

    def modelled_caches(self) -> dict[str, tuple[int, int]]:
        """Each modelled replica's cache size and the prompt tokens its model holds now (for
        ``/admin/stats`` and ``/metrics``: next to the engine's own KV usage)."""
        return {name: (cap, self._used.get(name, 0)) for name, cap in self._token_cap.items()}

    def held_weights(self, name: str, keys: Sequence[int]) -> list[int] | None:
        """What ``keys`` weigh in ``name``'s modelled cache, for a record that rebuilds them
        elsewhere (a catch-up snapshot): the first always, then up to the last that is not the
        standard weight (see :meth:`KeyWeights.of`); None when ``name`` is not modelled."""
        weights = self._weight.get(name)
        if weights is None or not keys:
            return None
        standard = self._default_weight
        values = [weights.get(key, standard) for key in keys]
        while len(values) > 1 and values[-1] == standard:
            values.pop()
        return values

    def memory_bytes(self) -> int:
        """What the index holds now, in bytes: its dicts (tables, nodes) and the ints in them.

        O(entries): for tests and occasional stats, never the hot path.
        """
        size = sys.getsizeof
        total = size(self._holders)
        total += sum(size(key) + (size(mask) if mask > 256 else 0) for key, mask in self._holders.items())
        total += size(self._child) + size(self._forks)
        total += sum(size(k) + size(v) for k, v in self._child.items())
        for lru in self._lru.values():  # a key's int may be a second object here: count it again
            total += size(lru) + sum(size(k) + (size(v) if v is not None and v > 256 else 0) for k, v in lru.items())
        for weights in self._weight.values():
            total += size(weights) + sum(size(w) for w in weights.values() if w > 256)
        return total

    def _trim_all(self) -> None:
        cap = self.capacity()
        for name in list(self._lru):
            self._trim(name, cap)

    def _trim(self, name: str, cap: int) -> None:
        """Keep ``name`` within ``cap`` keys and, when modelled, within its cache's tokens."""
        over = len(self._lru[name]) - cap
        token_cap = self._token_cap.get(name)
        if over > 0 or (token_cap is not None and self._used[name] > token_cap):
            self._evict_oldest(name, over, token_cap)

    def _evict_oldest(self, name: str, count: int, token_cap: int | None = None) -> None:
        """Drop ``name``'s least recently used keys (deepest keys of old prompts): at least
        ``count``, and then as many as its keys must lose to weigh at most ``token_cap``."""
        lru = self._lru[name]
        keep = ~(1 << self._slot[name])
        holders, child, forks = self._holders, self._child, self._forks
        weights = self._weight.get(name)
        standard = self._default_weight
        used = self._used.get(name, 0)
        limit = used if token_cap is None or weights is None else token_cap  # by count only: no limit
        popitem = lru.popitem
        while lru and (count > 0 or used > limit):
            count -= 1
            key = popitem(last=False)[0]
            if weights is not None:
                used -= weights.pop(key, standard)
            mask = holders.get(key, 0) & keep
            if mask:
                holders[key] = mask
            else:  # no replica holds it any more: forget what followed it (_forget_key)
                holders.pop(key, None)
                child.pop(key, None)
                forks.discard(key)
        if weights is not None:
            self._used[name] = used

    # -- the hot path ------------------------------------------------------------------
    def mask_of(self, replicas: Iterable[str] | None) -> int:
        """The bit mask :meth:`match` uses for ``replicas`` (None: every tracked one); a caller
        matching against the same set many times computes it once."""
        want = 0
        if replicas is None:
            for slot in self._names:
                want |= 1 << slot
            return want
        slot_of = self._slot
        for name in replicas:
            slot = slot_of.get(name)
            if slot is not None:
                want |= 1 << slot
        return want

    def match(self, keys: Sequence[int], replicas: Iterable[str] | None, mask: int | None = None) -> dict[str, int]:
        """For each of ``replicas`` (None: every tracked one; or those of ``mask``, from
        :meth:`mask_of`) with a match: the number of leading keys it holds (>= 1)."""
        want = self.mask_of(replicas) if mask is None else mask
        names = self._names
        depth: dict[str, int] = {}
        for d, found in self.match_groups(keys, want):
            while found:
                low = found & -found
                depth[names[low.bit_length() - 1]] = d
                found ^= low
        return depth

    def match_groups(self, keys: Sequence[int], want: int) -> list[tuple[int, int]]:
        """:meth:`match` by group, deepest first: (depth, mask of the replicas of ``want`` whose
        deepest match is there).  Replicas holding the same prefix form one group however
        many they are (a hot head on the whole fleet is one mask), so a caller need not
        look at them one by one.

        Probes every ``stride``-th key, then only the ``stride - 1`` keys after each group's:
        a replica holding a key holds every stored key before it in the chain (a record
        stores the stride keys along with the deepest and touches them after it, so LRU
        evicts them later, and ``unrecord`` takes back only keys it added), so its deepest
        key is at most ``stride - 1`` past its deepest stride key.  Same answer as probing
        every key, about ``stride`` times fewer probes.
        """
        groups: list[tuple[int, int]] = []
        if not want or not keys:
            return groups
        holders = self._holders
        stride = self.stride
        last = len(keys) - 1
        remaining = want  # wanted replicas not found yet
        by_stride: list[tuple[int, int]] = []  # (position of the deepest stride key held, who)
        for i in range(last - (last + 1) % stride, -1, -stride):
            mask = holders.get(keys[i])
            if mask is None:
                continue
            new = mask & remaining
            if not new:
                continue
            remaining ^= new
            by_stride.append((i, new))
            if not remaining:
                break
        if stride == 1:
            return [(i + 1, mask) for i, mask in by_stride]
        if remaining:
            by_stride.append((-1, remaining))  # holding no stride key: only a short prompt's deepest
        for i, mask in by_stride:
            # a deeper prompt end (not a stride key) among the next stride - 1 keys
            for j in range(min(i + stride - 1, last), i, -1):
                deeper = holders.get(keys[j])
                if deeper is None:
                    continue
                deeper &= mask
                if deeper:
                    groups.append((j + 1, deeper))
                    mask ^= deeper
                    if not mask:
                        break
            if mask and i >= 0:
                groups.append((i + 1, mask))
        groups.sort(key=_depth_first)
        return groups

    def slot_of(self, name: str) -> int | None:
        """``name``'s bit in masks (None: not tracked)."""
        return self._slot.get(name)

    def name_of(self, slot: int) -> str:
        return self._names[slot]

    def record(
        self,
        name: str,
        keys: Sequence[int],
        prompt_tokens: int | None = None,
        tokens_at: Callable[[int], int] | None = None,
        blocks: tuple[int, int] = (0, 0),
    ) -> list[int]:
        """``name`` is serving a prompt with these keys: it will hold them (most recent).

        ``prompt_tokens``: the whole prompt's length when it runs past the keyed window; it is
        kept with the deepest key so that a later request whose whole window matches can
        estimate how much more than the window is cached (see :meth:`extent`).
        ``tokens_at(depth)``: the prompt tokens the first ``depth`` keys cover, for the weights
        of a replica whose KV cache is modelled (default: :attr:`default_weight` per key), and
        ``blocks``: how many of the keys are whole token blocks, of what size (see
        :meth:`stored_weights`).  The attached sink (:meth:`attach_sink`) hears of every local
        record (to share it with other gateway processes).
        Returns the keys ``name`` did not hold before (what :meth:`unrecord` may take back).
        """
        if not keys:
            return []
        stored = self.stored_keys(keys)
        weights = None
        if tokens_at is not None and name in self._token_cap:
            weights = self.stored_weights(len(keys), tokens_at, prompt_tokens, blocks)
        added = self.record_stored(name, stored, prompt_tokens, weights)
        self._sink.recorded(name, stored, prompt_tokens, weights)  # peers weigh the keys as this record did
        return added

    def stored_keys(self, keys: Sequence[int]) -> list[int]:
        """The keys :meth:`record` keeps, deepest first: every ``stride``-th and the deepest."""
        stride = self.stride
        stored = list(keys[stride - 1 :: stride])  # blocks stride, 2 x stride, ... (1-based)
        if len(keys) % stride:
            stored.append(keys[-1])  # the deepest, when it is not one of them
        stored.reverse()
        return stored

    def stored_weights(
        self,
        depth: int,
        tokens_at: Callable[[int], int],
        prompt_tokens: int | None = None,
        blocks: tuple[int, int] = (0, 0),
    ) -> KeyWeights:
        """The weight of each of :meth:`stored_keys` for a prompt of ``depth`` keys, by its
        position there (deepest first): see :func:`gateway.routing.key_weights.stride_weights`."""
        return stride_weights(self.stride, self._default_weight, depth, tokens_at, prompt_tokens, blocks)

    def record_stored(
        self,
        name: str,
        stored: Sequence[int],
        prompt_tokens: int | None = None,
        weights: KeyWeights | None = None,
    ) -> list[int]:
        """Record keys already chosen by :meth:`stored_keys` (deepest first), e.g. from a peer.

        Deepest first, so the shared head of the prompt ends up most recently used;
        ``prompt_tokens`` goes with the deepest key.  ``weights`` (from :meth:`stored_weights`)
        weigh new keys in a modelled KV cache (default: :attr:`default_weight` each); keys
        already held keep the weight they came with (a key names one prefix, so it always adds
        the same tokens).
        """
        steps = self.record_stored_steps(name, stored, prompt_tokens, weights)
        while True:  # never pauses (no ``pause``): runs to its end at once
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

    def record_stored_steps(
        self,
        name: str,
        stored: Sequence[int],
        prompt_tokens: int | None = None,
        weights: KeyWeights | None = None,
        pause: int = 0,
    ) -> Generator[None, None, list[int]]:
        """:meth:`record_stored`, pausing (a bare ``yield``) after every ``pause`` keys (0: never).

        For a peer's record of up to 65,536 keys (~0.1 s at once): its applier lets the event
        loop run at each pause.  What others do meanwhile is safe: requests may match the keys
        recorded so far or record their own; if ``name`` leaves the pool, the rest is dropped.
        """
        if not stored:
            return []
        is_new = name not in self._slot
        bit = 1 << self._ensure(name)
        lru = self._lru[name]
        holders = self._holders
        child_of = self._child
        forks = self._forks
        added: list[int] = []
        # The deepest key is marked as the end of a prompt (0 without an extent): a later
        # request matching exactly there continues that prompt (a conversation's next turn).
        deepest = stored[0]
        extent = prompt_tokens or 0
        # A modelled cache weighs each new key; only weights other than the standard one (a
        # stride of whole blocks: most keys) are kept, so most keys cost no more memory.
        key_weights = self._weight.get(name)
        weight_of, special = None, 0
        if key_weights is not None:
            if weights is None:  # a record without weights (an older peer): positions unknown
                weights = even_weights(self._default_weight, len(stored), prompt_tokens)
            weight_of, special = weights.weight_of, weights.special
        standard = self._default_weight
        used = 0
        if deepest in lru:
            lru.move_to_end(deepest)
            if extent or lru[deepest] is None:
                lru[deepest] = extent
        else:
            lru[deepest] = extent
            holders[deepest] = holders.get(deepest, 0) | bit
            added.append(deepest)
            if key_weights is not None:
                used = weight = weight_of(0)  # type: ignore[misc]  # set above whenever weighing
                if weight != standard:
                    key_weights[deepest] = weight
        for i, (after, key) in enumerate(pairwise(stored), 1):
            if pause and i % pause == 0:
                yield
                if self._lru.get(name) is not lru:  # forgotten meanwhile (it left the pool)
                    return added
            # What followed this key in this prompt: a key followed by two different
            # continuations is a fork — a prefix several prompts share (a system prompt),
            # not one conversation's history.
            if child_of.setdefault(key, after) != after:
                forks.add(key)
            mark = lru.get(key, _MISSING)
            if mark is not _MISSING:
                lru.move_to_end(key)
                if mark is not None and key_weights is not None:
                    # An earlier prompt ended here (a conversation's last turn): its weight also
                    # carried that prompt past its keys, which this record's next key covers now.
                    weight = standard if i >= special else weight_of(i)  # type: ignore[misc]
                    held = key_weights.get(key, standard)
                    if weight < held:
                        used -= held - weight
                        if weight == standard:
                            del key_weights[key]
                        else:
                            key_weights[key] = weight
            else:
                lru[key] = None
                holders[key] = holders.get(key, 0) | bit
                added.append(key)
                if i >= special:  # a stride of whole blocks (or no model: special is 0)
                    used += standard
                else:
                    weight = weight_of(i)  # type: ignore[misc]  # set whenever special > 0
                    used += weight
                    if weight != standard:
                        key_weights[key] = weight  # type: ignore[index]
        if key_weights is not None and used:
            self._used[name] += used
        if is_new:
            self._trim_all()
        else:
            self._trim(name, self.capacity())
        return added

    def unrecord(self, name: str, keys: Sequence[int]) -> None:
        """Take back keys a :meth:`record` added for ``name`` whose request it never served
        (no 2xx answer): the index must not teach a replica that never computed the prefix.
        Pass only what :meth:`record` returned (the keys it added), never the whole prompt's:
        what ``name`` held before — a shared head from earlier served requests — stays.  The
        attached sink hears of the withdrawal too, so peers that applied the record take the
        same keys back (:meth:`withdraw`)."""
        taken = self.withdraw(name, keys)
        if taken:
            self._sink.withdrawn(name, taken)

    def withdraw(self, name: str, keys: Sequence[int]) -> list[int]:
        """Drop ``keys`` from ``name`` without telling the sink (a peer's withdrawal, or
        :meth:`unrecord`'s own work); returns the keys ``name`` held and no longer does."""
        lru = self._lru.get(name)
        slot = self._slot.get(name)
        if lru is None or slot is None:
            return []
        bit = 1 << slot
        holders = self._holders
        key_weights = self._weight.get(name)
        taken: list[int] = []
        for key in keys:
            if lru.pop(key, _MISSING) is _MISSING:
                continue
            taken.append(key)
            if key_weights is not None:
                self._used[name] -= key_weights.pop(key, self._default_weight)
            mask = holders.get(key, 0) & ~bit
            if mask:
                holders[key] = mask
            else:
                holders.pop(key, None)
                self._forget_key(key)
        return taken

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a tracked replica (records for others are ignored by callers)."""
        return name in self._slot

    def holds(self, name: str, key: int) -> bool:
        """Whether ``name`` holds ``key`` (a prompt's deepest key: the whole prompt)."""
        lru = self._lru.get(name)
        return lru is not None and key in lru

    def extent(self, name: str, key: int) -> int | None:
        """Prompt tokens of the last request ``name`` served whose keys ended at ``key`` (None: unknown)."""
        lru = self._lru.get(name)
        return (lru.get(key) or None) if lru is not None else None

    def is_fork(self, key: int) -> bool:
        """Whether recorded prompts went on differently after ``key`` (a shared prefix).

        A conversation's history is followed by one continuation (its own next turns); a
        tenant's system prompt by as many as there are conversations.  (Keys are stored every
        ``stride`` blocks plus each prompt's deepest, so a conversation's older keys may fork
        between a turn's deepest key and the next turn's stride key; its newest keys, where
        the next turn matches, do not.)
        """
        return key in self._forks

    def forks_at(self, keys: Sequence[int], depth: int) -> bool:
        """Whether the first ``depth`` of ``keys`` are a shared prefix, as far as the index knows:
        :meth:`is_fork` of the deepest key it stores at or below ``depth`` (at most ``stride - 1``
        below).

        A match the index did not make can end between its stored keys: the precise index's
        (engine blocks, and text keys at chunk resolution) ends where the prompt first differs,
        which behind a shared head is the head's exact end, not a stride key.  Asking only the
        key at that depth (never stored, so never a fork) made every new conversation behind
        the head look like its holder's own history: no start was counted for that head.
        """
        holders = self._holders
        for i in range(depth - 1, max(-1, depth - 1 - self.stride), -1):
            if keys[i] in holders:
                return keys[i] in self._forks
        return False

    # -- introspection -----------------------------------------------------------------
    def __len__(self) -> int:
        """Distinct keys indexed."""
        return len(self._holders)

    def entries(self, name: str | None = None) -> int:
        """(key, replica) pairs held, for one replica or all."""
        if name is not None:
            lru = self._lru.get(name)
            return 0 if lru is None else len(lru)
        return sum(len(lru) for lru in self._lru.values())

    def holders(self, key: int) -> list[str]:
        mask = self._holders.get(key, 0)
        return [self._names[s] for s in sorted(self._names) if mask >> s & 1]
