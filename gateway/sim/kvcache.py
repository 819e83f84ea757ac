"""The simulated GPU KV cache: a fixed pool of blocks with vLLM's prefix-caching rules.

Mirrors vLLM v1's ``BlockPool`` / ``KVCacheManager`` where it matters for routing:

- capacity is ``num_gpu_blocks - 1`` blocks of ``block_size`` tokens (vLLM keeps one as
  its null block; the engine passes the usable count);
- a block is *cached* once it is full and computed; its key is the chained block hash
  (:func:`gateway.prefix.blocks.chain_block_keys`), so a key names a whole prefix;
- blocks referenced by running requests are pinned; every other block sits in one free
  queue, and allocation takes from the head, evicting the cached key of the block it takes;
- a finished request frees its blocks tail-first, so the tail of a prompt is evicted
  before its (more shareable) head; freed blocks that hold no key (a partial last block)
  go to the front of the queue and are reused first, cached ones to the back (LRU), as in
  vLLM 0.32;
- a lookup returns the longest run of cached leading blocks, capped below the prompt's
  last token (see :func:`hit_block_limit`);
- a block computed again while an identical one is cached (the recomputed last block of a
  repeated prompt, two identical prompts at once) is a second *copy* under the same key:
  lookups find the first, and the key stays cached until its last copy is evicted
  (vLLM's ``BlockHashToBlockMap``).  Every eviction of a keyed block is reported to
  ``on_evict`` (vLLM's ``BlockRemoved``), one call per copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


def hit_block_limit(num_tokens: int, block_size: int) -> int:
    """How many leading blocks may count as a hit for a sequence of ``num_tokens`` tokens.

    vLLM must compute at least the last token to get logits, so it caps the hit at
    ``num_tokens - 1`` tokens, and hits are whole blocks.  Hence a fully cached prompt
    recomputes its last *block* when its length is a multiple of ``block_size``, and its
    partial tail otherwise (``KVCacheManager.get_computed_blocks``).
    """
    return max(num_tokens - 1, 0) // block_size


class Block:
    """One KV block.  ``key`` is set while the block holds a cached, full, computed block."""

    __slots__ = ("block_id", "key", "ref")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref = 0
        self.key: int | None = None


class PrefixCache:
    """Block pool + key index.  Not thread-safe: one engine (one event loop) owns it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self._blocks)
        self._cached: dict[int, Block] = {}
        self._copies: dict[int, list[Block]] = {}  # key -> further blocks holding it
        self.on_evict: Callable[[int], None] | None = None

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks not referenced by any request (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: the share of blocks pinned by requests (0..1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def copies(self) -> dict[int, int]:
        """Every cached key with how many blocks hold it (what KV events let a consumer count)."""
        out = dict.fromkeys(self._cached, 1)
        for key, extra in self._copies.items():
            out[key] += len(extra)
        return out

    def contains(self, key: int) -> bool:
        return key in self._cached

    def lookup(self, keys: Sequence[int], num_tokens: int) -> list[Block]:
        """The cached blocks of the longest cached prefix of ``keys`` (hit cap applied)."""
        limit = min(len(keys), hit_block_limit(num_tokens, self.block_size))
        cached = self._cached
        hit: list[Block] = []
        for i in range(limit):
            block = cached.get(keys[i])
            if block is None:
                break
            hit.append(block)
        return hit

    def can_allocate(self, hit: Sequence[Block], num_new: int) -> bool:
        """Whether ``hit`` can be pinned and ``num_new`` fresh blocks taken right now."""
        if num_new <= 0:
            return True
        reclaimed = 0
        for block in hit:
            if block.ref == 0:
                reclaimed += 1
        return num_new <= len(self._free) - reclaimed

    # -- mutations -------------------------------------------------------------------------
    def touch(self, hit: Sequence[Block]) -> None:
        """Pin hit blocks for a request (removing free ones from the eviction queue)."""
        free = self._free
        for block in hit:
            if block.ref == 0:
                del free[block.block_id]
            block.ref += 1

    def allocate(self, num: int) -> list[Block]:
        """Take ``num`` blocks from the LRU head (caller checked :meth:`can_allocate`)."""
        out: list[Block] = []
        free = self._free
        for _ in range(num):
            _, block = free.popitem(last=False)
            key = block.key
            if key is not None:
                self._drop_key(block, key)
            block.ref = 1
            out.append(block)
        return out

    def commit(self, blocks: Sequence[Block], keys: Sequence[int], start: int, end: int) -> None:
        """Mark ``blocks[start:end]`` as computed full blocks holding ``keys[start:end]``.

        If another block already holds the same key, this one becomes a further copy; the
        first stays the one lookups find, as in vLLM.
        """
        cached = self._cached
        for i in range(start, end):
            block = blocks[i]
            if block.key is None:
                key = keys[i]
                block.key = key
                if key in cached:
                    self._copies.setdefault(key, []).append(block)
                else:
                    cached[key] = block

    def _drop_key(self, block: Block, key: int) -> None:
        """``block`` is taken for new data: forget its copy of ``key`` (and say so)."""
        cached = self._cached
        copies = self._copies.get(key)
        if cached.get(key) is block:
            if copies:
                cached[key] = copies.pop()
            else:
                del cached[key]
        elif copies is not None:
            copies.remove(block)
        if copies is not None and not copies:
            del self._copies[key]
        block.key = None
        if self.on_evict is not None:
            self.on_evict(key)

    def free(self, blocks: Sequence[Block]) -> None:
        """Unpin a request's blocks, tail block first (vLLM 0.32's ``BlockPool.free_blocks``).

        Unreferenced cached blocks join the LRU tail (evicted last); blocks holding no key (a
        partial tail) go to the *front*, so they are reused before anything cached is evicted.
        """
        free = self._free
        uncached: list[Block] = []
        for block in reversed(blocks):
            block.ref -= 1
            if block.ref == 0:
                free[block.block_id] = block
                if block.key is None:
                    uncached.append(block)
        for block in reversed(uncached):
            free.move_to_end(block.block_id, last=False)

    def reset(self) -> None:
        """Forget every cached block (a restart).  Only valid when no request holds blocks."""
        if len(self._free) != self.num_blocks:
            raise RuntimeError("cannot reset the prefix cache while requests hold blocks")
        for block in self._blocks:
            block.key = None
        self._cached.clear()
        self._copies.clear()
        self._free = OrderedDict((b.block_id, b) for b in self._blocks)
