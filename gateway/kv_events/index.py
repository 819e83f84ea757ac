"""What each replica's engine really holds, in the gateway's own block keys.

Fed by the engines' KV cache events (:mod:`gateway.kv_events.decoder`).  The engine's block
hashes are its own (SHA-256 over pickle, or CBOR, seeded per process), so they are never
compared with ours: each ``BlockStored``'s ``token_ids`` are re-hashed with
:func:`~gateway.prefix.blocks.chain_block_keys`, seeded by
:func:`~gateway.prefix.blocks.engine_seed` (the replica's base model, the event's LoRA name
and the ``cache_salt`` from the first block's extra keys) when the chain starts there, or
chained from the parent block's key, found through a per-replica map engine hash → our key.
That map is also what makes ``BlockRemoved`` work.  The engine may hold several physical
copies of one block (the same prompt's last block is recomputed and stored again), each
removed on its own, so copies are counted per (replica, engine hash).

**Only keys a request can produce are kept.**  The request side hashes token blocks over a
route's leading window only (``prefix.window_tokens``, 4,096 by default) and text chunks past
it, which no event can reproduce; so blocks deeper than ``max_depth_tokens`` (the largest
window of the routes) are not keyed (counted as ``deep``), and the index's memory goes to
the part of the cache routing can use.  Past the window, the router extends a precise
match with its own records (see :mod:`gateway.kv_events.routing`); the blocks there are kept
by depth alone under the window's last key (:mod:`gateway.kv_events.deep`), which bounds what
those records may credit.

**Keys at the route's block size.**  A route hashes one block size; an engine at a multiple
of it (a fleet mid-way through a ``--block-size`` change, or a size set by hand under 128-token
CPU engines) would never match keys at its own size.  :meth:`PreciseIndex.key_at` asks for a
replica's blocks keyed at the route's size: each engine block then gets ``engine / route``
keys (every one chained, as the request side chains them), all dropped when it is removed.
A replica's keys have one size at a time (:meth:`PreciseIndex.keyed_size`); a change of
size re-keys nothing (the tokens are gone), so the replica's entries are dropped and
relearned from its next events.

Only full-attention groups are indexed (sliding-window or Mamba groups hold blocks that do
not make a prefix hit on their own), on the ``GPU`` medium (offload tiers are not the
prefix cache a request hits).

Memory is bounded in bytes: every indexed key of a (replica, engine hash) costs
:data:`ENTRY_BYTES` at most; over ``max_bytes``, the replica holding the most keys loses its oldest ones
(first stored).  The engine still holds them, so the index then under-predicts that
replica (a shorter match, never a longer one); size ``max_bytes`` to the fleet's caches
(see docs/kv_events.md).  Not thread-safe: one event loop feeds and reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.kv_events.decoder import AllBlocksCleared, BlockRemoved, BlockStored, Event
from gateway.kv_events.deep import DEEP_BYTES, DeepBlocks
from gateway.prefix.blocks import chain_block_keys, engine_seed

# Bytes one indexed (replica, engine hash) pair costs at most: the engine map's entry (dict
# slot, the hash int, a 3-item list, our key int), the replica's key refcount entry and its
# share of the holders dict, just after a resize.  tracemalloc: tests/kv_events/test_index.py.
ENTRY_BYTES = 400
# ... and with the LRU clock (track_lru, for the projection): each key's stamp, a dict slot and an int
LRU_BYTES = 100
_FIXED_BYTES = 2048  # per replica: its dicts and sets, empty

_KEY, _DEPTH, _COPIES, _FINER = 0, 1, 2, 3
_AGE_WEIGHT = 1 / 64  # the eviction age's moving mean: over the last few hundred evictions
PROBE_STRIDE = 8  # leading(): keys probed per stretch (see there)
FULL_KINDS = (None, "full_attention")
MEDIA = (None, "GPU")
#: Why an event (or part of one) was not indexed, as metric labels (bounded).
SKIP_REASONS = ("group", "medium", "bad_tokens", "unchained", "deep", "multimodal", "no_model", "unknown_removed")


@dataclass(slots=True)
class _Replica:
    slot: int
    base_model: str | None = None
    # engine hash -> [our (last) key, depth in engine blocks, copies] (+ every key of the block, keyed finer)
    engine: dict[int | bytes, list[Any]] = field(default_factory=dict)
    refs: dict[int, int] = field(default_factory=dict)  # our key -> engine hashes naming it
    block_size: int | None = None  # of its last (well-formed) BlockStored: the size ``unit`` was chosen for
    unit: int | None = None  # tokens per key of its entries (None: nothing stored yet)
    keys: int = 0  # our keys its entries hold (an entry keyed finer holds several)
    # The projection (see PreciseIndex.surviving): the engine's free queue as an age per key.
    stamp: dict[int, int] = field(default_factory=dict)  # our key -> the clock at its last store/touch
    clock: int = 0  # keys' worth of blocks the engine stored so far (each allocation pushes its LRU)
    evict_age: float | None = None  # keys' worth stored between a key's last use and its eviction (mean)
    deep: DeepBlocks = field(default_factory=DeepBlocks)  # its blocks past the window, by depth alone
    deep_dropped: bool = False  # ... dropped for the byte bound: past the window it says nothing until a clear
    full_groups: set[int] = field(default_factory=set)
    other_groups: set[int] = field(default_factory=set)


class PreciseIndex:
    """Our block key → the replicas whose engine holds it (a bit mask), fed by KV events."""

    def __init__(self, max_bytes: int, max_depth_tokens: int = 4096) -> None:
        if max_bytes < 1 or max_depth_tokens < 1:
            raise ValueError("max_bytes and max_depth_tokens must be >= 1")
        self.max_bytes = max_bytes
        self.max_depth_tokens = max_depth_tokens
        self._replicas: dict[str, _Replica] = {}
        self._names: dict[int, str] = {}
        self._holders: dict[int, int] = {}
        self._entries = 0
        self._deep_entries = 0  # blocks past the window, over all replicas (DeepBlocks)
        self.generation = 0  # moves whenever a slot is given or taken: masks from mask_of() expire
        self.keying = 0  # moves whenever a replica's key size changes (keyed_size)
        self._wants: dict[str, dict[str, int]] = {}  # replica -> route -> the block size it hashes (key_at)
        self.evicted = 0
        # Keep the LRU clock's stamps (the projection, kv_events.project_evictions): set by the
        # router that projects; off, stores cost no stamp
        self.track_lru = False
        self.skipped: dict[str, int] = dict.fromkeys(SKIP_REASONS, 0)
        # hears (replica, our keys) of every BlockStored indexed: the router's speculative
        # choices end when the engine confirms them
        self.on_stored: Callable[[str, list[int]], None] | None = None
        # ... and of every clear: (replica, lost) — lost: the engine's cache is gone (AllBlocksCleared,
        # a restart, another model), not only the index's record of it (a gap, a replica leaving)
        self.on_cleared: Callable[[str, bool], None] | None = None

    # -- membership ------------------------------------------------------------------------
    def add(self, name: str, base_model: str | None = None) -> None:
        """Track ``name`` (its engine's base served model id seeds chains that start there)."""
        replica = self._replicas.get(name)
        if replica is None:
            slot = next(i for i in range(len(self._names) + 1) if i not in self._names)
            replica = self._replicas[name] = _Replica(slot)
            self._names[slot] = name
            self.generation += 1
        if base_model is not None:
            replica.base_model = base_model

    def set_model(self, name: str, base_model: str) -> None:
        """The replica's base model changed (a redeploy): what it held was another model's."""
        replica = self._replicas.get(name)
        if replica is not None and replica.base_model not in (None, base_model):
            self.clear(name)
        self.add(name, base_model)

    def forget(self, name: str) -> None:
        """``name`` left: drop it and its slot (and the routes' sizes for it: it left them too)."""
        self._wants.pop(name, None)
        if name not in self._replicas:
            return
        self.clear(name, lost=False)
        replica = self._replicas.pop(name)
        del self._names[replica.slot]
        self.generation += 1

    def clear(self, name: str, lost: bool = True) -> None:
        """Everything ``name`` held is gone (``AllBlocksCleared``, a restart, an unreplayed gap);
        ``lost=False``: the engine may still hold it, the index lost track (a gap, a replica leaving)."""
        replica = self._replicas.get(name)
        if replica is None:
            return
        keep = ~(1 << replica.slot)
        holders = self._holders
        for key in replica.refs:
            mask = holders.get(key, 0) & keep
            if mask:
                holders[key] = mask
            else:
                holders.pop(key, None)
        self._entries -= replica.keys
        replica.keys = 0
        self._deep_entries -= replica.deep.clear()
        replica.deep_dropped = False
        replica.engine = {}
        replica.refs = {}
        replica.stamp = {}
        if self.on_cleared is not None:
            self.on_cleared(name, lost)

    def knows(self, name: str) -> bool:
        return name in self._replicas

    # -- key size --------------------------------------------------------------------------
    def key_at(self, name: str, route: str, block_size: int | None) -> None:
        """``route`` hashes ``block_size``-token blocks (None: it left): ``name``'s blocks are
        keyed at that size where its engine's is a multiple of it (the smallest such size
        asked, when routes disagree), else at the engine's own (see the module doc)."""
        wants = self._wants.setdefault(name, {})
        if block_size:
            wants[route] = block_size
        else:
            wants.pop(route, None)
            if not wants:
                del self._wants[name]
        replica = self._replicas.get(name)
        if replica is not None and replica.block_size is not None:
            self._rekey(name, replica, replica.block_size)

    def key_route(self, route: str, block_size: int, names: Iterable[str]) -> None:
        """``route`` hashes ``block_size``-token blocks over exactly ``names`` now: :meth:`key_at`
        for each, and the route's size withdrawn from the replicas that left it."""
        members = set(names)
        for name in [name for name, wants in self._wants.items() if route in wants and name not in members]:
            self.key_at(name, route, None)
        for name in members:
            self.key_at(name, route, block_size)

    def keep_routes(self, routes: Container[str]) -> None:
        """Only ``routes`` exist now (a reload): other routes' sizes no longer count."""
        for name, wants in list(self._wants.items()):
            for route in [route for route in wants if route not in routes]:
                self.key_at(name, route, None)

    def keyed_size(self, name: str) -> int | None:
        """Tokens per key of ``name``'s entries (None: nothing stored yet): a route hashing
        another size finds none of them."""
        replica = self._replicas.get(name)
        return None if replica is None else replica.unit

    def keys_per_block(self, name: str) -> int:
        """Our keys per engine block of ``name`` (1 unless keyed finer than its engine)."""
        replica = self._replicas.get(name)
        if replica is None or not replica.unit or not replica.block_size:
            return 1
        return max(1, replica.block_size // replica.unit)

    def _rekey(self, name: str, replica: _Replica, engine_size: int) -> int:
        """The key size for ``engine_size``-token blocks; a change drops what was keyed at the old one.

        The engine's own size where a route hashes it (that route's keys match one to one; a
        route asking a finer size over the same replica is routed by the model there), else
        the smallest size asked that divides it — only while the index's window is a whole
        number of engine blocks: a finer-keyed window that ended inside an engine block would
        never hold a request's whole window (nor the bound past it)."""
        wants = self._wants.get(name, {}).values()
        unit = engine_size
        if engine_size not in wants and self.max_depth_tokens % engine_size == 0:
            unit = min((size for size in wants if engine_size % size == 0), default=engine_size)
        if unit != replica.unit:
            if replica.unit is not None and (replica.engine or len(replica.deep)):
                self.clear(name, lost=False)  # the engine still holds them; no event reproduces the tokens
            replica.unit = unit
            replica.evict_age = None  # counted in keys of the old size
            self.keying += 1
        return unit

    # -- ingestion -------------------------------------------------------------------------
    def apply(self, name: str, events: Iterable[Event]) -> None:
        """Apply one batch's events to ``name`` (an unknown replica is added)."""
        replica = self._replicas.get(name)
        if replica is None:
            self.add(name)
            replica = self._replicas[name]
        for event in events:
            if isinstance(event, BlockStored):
                self._store(replica, event)
            elif isinstance(event, BlockRemoved):
                self._remove(replica, event)
            elif isinstance(event, AllBlocksCleared):
                self.clear(name)
        if self.memory_bytes() > self.max_bytes:
            self._evict()

    def _skip(self, reason: str, count: int = 1) -> None:
        self.skipped[reason] += count

    def _store(self, replica: _Replica, event: BlockStored) -> None:
        group = event.group_idx or 0
        if event.kv_cache_spec_kind not in FULL_KINDS:
            replica.other_groups.add(group)
            self._skip("group")
            return
        if event.medium not in MEDIA:
            self._skip("medium")
            return
        replica.full_groups.add(group)
        size = event.block_size
        hashes = event.block_hashes
        tokens = event.token_ids
        if size < 1 or len(tokens) != len(hashes) * size:
            self._skip("bad_tokens")  # its size says nothing about the engine's blocks either
            return
        name = self._names[replica.slot]
        unit = replica.unit
        if unit is None or size != replica.block_size:
            unit = self._rekey(name, replica, size)
        replica.block_size = size
        per = size // unit  # our keys per engine block
        replica.clock += len(hashes) * per  # every block it stored took one from its free queue
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            seed = self._seed(replica, event)
            if seed is None:
                return
            parent, depth = seed, 0
        else:
            known = replica.engine.get(parent_hash)
            if known is None:
                past = replica.deep.parent(parent_hash)
                if past is not None:  # continues a chain past the window
                    self._store_deep(replica, past[0], past[1], hashes[: _plain_blocks(event)])
                    self._skip("deep")
                    return
                self._skip("unchained")  # stored before we listened, or evicted here
                return
            parent, depth = known[_KEY], known[_DEPTH]
        window = self.max_depth_tokens // size
        plain = _plain_blocks(event)
        take = min(len(hashes), window - depth, plain)
        if take < len(hashes):
            self._skip("deep" if take == window - depth else "multimodal")
        if take <= 0:
            if depth == window and plain:  # the window ended at the parent: this chain is past it
                self._store_deep(replica, parent, 0, hashes[:plain])
            return
        try:
            keys = chain_block_keys(tokens, unit, parent, take * per)
        except (OverflowError, TypeError, ValueError):  # ids that are not u32 ints
            self._skip("bad_tokens")
            return
        if take == window - depth and plain > take:  # the window ends inside this event
            self._store_deep(replica, keys[-1], 0, hashes[take:plain])
        if self.on_stored is not None:
            self.on_stored(name, keys)
        engine, refs, holders, stamp = replica.engine, replica.refs, self._holders, replica.stamp
        bit = 1 << replica.slot
        now, track = replica.clock, self.track_lru
        if per == 1:
            for i in range(take):
                block = hashes[i]
                key = keys[i]
                if track:
                    stamp[key] = now  # computed (again): at the back of the free queue once freed
                entry = engine.get(block)
                if entry is not None:
                    entry[_COPIES] += 1
                    continue
                engine[block] = [key, depth + i + 1, 1]
                self._entries += 1
                replica.keys += 1
                held = refs.get(key, 0)
                refs[key] = held + 1
                if not held:
                    holders[key] = holders.get(key, 0) | bit
            return
        if track:
            for key in keys:
                stamp[key] = now
        for i in range(take):  # keyed finer: each engine block names ``per`` of our keys
            block = hashes[i]
            entry = engine.get(block)
            if entry is not None:
                entry[_COPIES] += 1
                continue
            finer = tuple(keys[i * per : (i + 1) * per])
            engine[block] = [finer[-1], depth + i + 1, 1, finer]
            self._entries += per
            replica.keys += per
            for key in finer:
                held = refs.get(key, 0)
                refs[key] = held + 1
                if not held:
                    holders[key] = holders.get(key, 0) | bit

    def _store_deep(self, replica: _Replica, anchor: int, depth: int, hashes: Sequence[int | bytes]) -> None:
        """Blocks past the window, kept by depth under the window's last key (:mod:`gateway.kv_events.deep`)."""
        self._deep_entries += replica.deep.store(anchor, depth, hashes)

    def _seed(self, replica: _Replica, event: BlockStored) -> int | None:
        """The first block's seed: base model, LoRA name and ``cache_salt`` as the engine keys them."""
        if replica.base_model is None:
            self._skip("no_model")
            return None
        salt: str | None = None
        extra = event.extra_keys[0] if event.extra_keys else None
        if isinstance(extra, list):
            items = extra
            if event.lora_name and items and items[0] == event.lora_name:
                items = items[1:]  # the LoRA name comes first when lora_name is set
            salt = next((item for item in items if isinstance(item, str)), None)
        return engine_seed(replica.base_model, event.lora_name, salt)

    def _remove(self, replica: _Replica, event: BlockRemoved) -> None:
        group = event.group_idx or 0
        if group in replica.other_groups and group not in replica.full_groups:
            return  # a sliding-window (or other) group's block: never indexed
        if event.medium not in MEDIA:
            return
        engine = replica.engine
        for block in event.block_hashes:
            entry = engine.get(block)
            if entry is None:
                gone = replica.deep.remove(block)
                if gone is None:
                    self._skip("unknown_removed")
                elif gone:
                    self._deep_entries -= 1
                continue
            entry[_COPIES] -= 1
            if entry[_COPIES] <= 0:
                del engine[block]
                at = replica.stamp.get(entry[_KEY])
                if at is not None:  # how old the front of its free queue is, in allocations
                    age = max(0, replica.clock - at)
                    mean = replica.evict_age
                    replica.evict_age = age if mean is None else mean + (age - mean) * _AGE_WEIGHT
                self._drop_entry(replica, entry)

    def _drop_entry(self, replica: _Replica, entry: list[Any]) -> None:
        """An engine block is gone: each of our keys it named loses one reference."""
        if len(entry) > _FINER:
            for key in entry[_FINER]:
                self._drop_key(replica, key)
        else:
            self._drop_key(replica, entry[_KEY])

    def _drop_key(self, replica: _Replica, key: int) -> None:
        self._entries -= 1
        replica.keys -= 1
        refs = replica.refs
        held = refs.get(key, 0) - 1
        if held > 0:
            refs[key] = held
            return
        refs.pop(key, None)
        replica.stamp.pop(key, None)
        mask = self._holders.get(key, 0) & ~(1 << replica.slot)
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)

    def _evict(self) -> None:
        """Over the byte bound: the biggest replica loses its oldest entries (see module doc)."""
        for replica in sorted(self._replicas.values(), key=lambda r: -len(r.deep)):
            if self.memory_bytes() <= self.max_bytes:
                return
            self.evicted += len(replica.deep)  # the bound past the window goes first: the model's word remains
            self._deep_entries -= replica.deep.clear()
            replica.deep_dropped = True
        budget = (self.max_bytes - _FIXED_BYTES * len(self._replicas)) // self.entry_bytes()
        target = max(0, budget - max(1, budget // 64))  # a little room, so eviction runs in batches
        while self._entries > target:
            replica = max(self._replicas.values(), key=lambda r: r.keys)
            engine = replica.engine
            if not engine:
                break
            while engine and self._entries > target:
                entry = engine.pop(next(iter(engine)))
                self.evicted += 1
                self._drop_entry(replica, entry)

    # -- reading ---------------------------------------------------------------------------
    def mask_of(self, names: Iterable[str] | None = None) -> int:
        """The bit mask of ``names`` (None: every tracked replica), for :meth:`leading`."""
        want = 0
        for name in self._replicas if names is None else names:
            replica = self._replicas.get(name)
            if replica is not None:
                want |= 1 << replica.slot
        return want

    def leading(
        self, keys: Sequence[int], names: Iterable[str] | None = None, mask: int | None = None
    ) -> dict[str, int]:
        """For each of ``names`` (or the replicas of ``mask`` from :meth:`mask_of`; None: all)
        whose engine holds ``keys[0]``: how many leading keys it holds in a row — vLLM's own
        lookup stops at the first missing block.

        Probes every ``PROBE_STRIDE``-th key, then the keys since the last probe for the
        replicas a probe lost, so a full window costs ~1/8 of the lookups.  A hole inside a
        stretch the engine holds on both sides goes unseen; vLLM frees a request's blocks tail
        first, so its cache loses the ends of prefixes, not their middles.
        """
        remaining = self.mask_of(names) if mask is None else mask
        depth: dict[str, int] = {}
        holders = self._holders
        n = len(keys)
        if not n or not remaining:
            return depth
        prev = -1
        probe = min(PROBE_STRIDE, n) - 1
        while True:
            held = holders.get(keys[probe], 0) & remaining
            lost = remaining ^ held
            k = prev + 1
            while lost and k <= probe:  # each lost replica's first miss lies in (prev, probe]
                still = holders.get(keys[k], 0) & lost
                gone = lost ^ still
                if gone and k:
                    self._assign(depth, gone, k)
                lost = still
                k += 1
            remaining = held
            if not remaining:
                return depth
            if probe == n - 1:
                self._assign(depth, remaining, n)
                return depth
            prev, probe = probe, min(probe + PROBE_STRIDE, n - 1)

    def _assign(self, depth: dict[str, int], mask: int, value: int) -> None:
        names = self._names
        while mask:
            low = mask & -mask
            depth[names[low.bit_length() - 1]] = value
            mask ^= low

    # -- the projection ----------------------------------------------------------------------
    def touch(self, name: str, keys: Sequence[int], ahead_blocks: int = 0) -> None:
        """The gateway sent a request with these leading ``keys`` to ``name``: the blocks of
        them its engine holds will be hit (pinned, then freed to the back of its free queue)
        once the ``ahead_blocks`` its queue allocates before that have been allocated — so
        they are as young as blocks stored then.  Events never say so (a hit stores nothing),
        and without it a hot head would age as if no request had used it since it was stored.
        Stops at the first key the engine does not hold (the engine's lookup does too).
        """
        replica = self._replicas.get(name)
        if replica is None:
            return
        stamp = replica.stamp
        at = replica.clock + max(0, ahead_blocks)
        for key in keys:
            held = stamp.get(key)
            if held is None:
                return
            if held < at:  # a touch promised for later (queued work ahead) stays
                stamp[key] = at

    def surviving(self, name: str, keys: Sequence[int], depth: int, allocate_blocks: int, capacity_blocks: int) -> int:
        """How many of the ``depth`` leading ``keys`` ``name`` holds now are still held once
        its engine has allocated ``allocate_blocks`` more blocks (the work queued ahead of
        this request there), with a cache of ``capacity_blocks``.

        vLLM allocates from the head of one LRU free queue (a freed request's blocks go to
        the back), so a block is gone once more blocks than the cache holds were allocated
        since it was last used.  Each key's last use is a stamp on a clock that counts the
        blocks the engine stored (the allocations that push its queue), moved on by
        :meth:`touch` (a request sent there, one finished there); the projected front is
        ``clock + allocate_blocks - capacity_blocks``.  A request's chain is stored and touched
        together, its head no older than its tail, so the surviving depth is the first key
        older than that front, found by bisection (O(log depth)).  Blocks the engine already
        evicted are gone from the index by its ``BlockRemoved``.
        """
        replica = self._replicas.get(name)
        if replica is None or depth <= 0 or allocate_blocks <= 0:
            return depth
        budget = capacity_blocks if replica.evict_age is None else min(capacity_blocks, replica.evict_age)
        front = replica.clock + allocate_blocks - budget
        stamp = replica.stamp
        if stamp.get(keys[0], -1) < front:
            return 0
        lo, hi = 1, depth  # keys[:lo] survive; keys[hi:] are not asked about
        while lo < hi:
            mid = (lo + hi) // 2
            if stamp.get(keys[mid], -1) >= front:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def block_size(self, name: str) -> int | None:
        """The block size of ``name``'s last ``BlockStored`` (None: none seen)."""
        replica = self._replicas.get(name)
        return None if replica is None else replica.block_size

    def blocks(self, name: str | None = None) -> int:
        """Indexed (replica, engine hash) pairs, of one replica or all."""
        if name is None:
            return sum(len(replica.engine) for replica in self._replicas.values())
        replica = self._replicas.get(name)
        return 0 if replica is None else len(replica.engine)

    def reach_past(self, name: str, anchor: int) -> int | None:
        """Keys' worth of blocks ``name``'s engine holds past the window's last key ``anchor``,
        along its deepest chain there (None: ``anchor`` is not held there, or not a window's end)."""
        replica = self._replicas.get(name)
        if replica is None or replica.deep_dropped or not self.holds(name, anchor):
            return None
        return replica.deep.reach(anchor) * self.keys_per_block(name)

    def holds(self, name: str, key: int) -> bool:
        replica = self._replicas.get(name)
        return replica is not None and bool(self._holders.get(key, 0) >> replica.slot & 1)

    def memory_bytes(self) -> int:
        """The bytes the bound counts (what :meth:`entry_bytes` budgets)."""
        return self._entries * self.entry_bytes() + self._deep_entries * DEEP_BYTES + _FIXED_BYTES * len(self._replicas)

    def entry_bytes(self) -> int:
        """Bytes budgeted per indexed block: :data:`ENTRY_BYTES`, plus :data:`LRU_BYTES` with the clock."""
        return ENTRY_BYTES + (LRU_BYTES if self.track_lru else 0)


def _plain_blocks(event: BlockStored) -> int:
    """Leading blocks whose extra keys name no multimodal input (``(mm_id, offset)`` pairs):
    the request side keys images past them as text, never as these blocks."""
    extra = event.extra_keys
    if not extra:
        return len(event.block_hashes)
    for i, item in enumerate(extra):
        if isinstance(item, list) and any(isinstance(part, list) for part in item):
            return i
    return len(event.block_hashes)
