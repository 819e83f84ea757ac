"""Every text key past the token window, per replica: the precise match's resolution there.

Past a route's token window the request's key chain goes on over its text in chunks
(``prefix.chunk_bytes``, ~250 tokens each), which no KV event can name; a precise replica
whose engine holds the whole window is credited there with what the affinity model recorded
(:mod:`gateway.kv_events.routing`).  The model keeps only every ``stride``-th key (4) and
each prompt's deepest, so past the window its match stops up to ``stride - 1`` chunks short
of what the replica holds: ~400-500 tokens on long RAG and agent prompts, where the engine
then reports more cached than predicted (measured: benchmarks/README.md, "Precise routing
from KV events").  Inside the window the engine's word has block resolution; this restores
chunk resolution past it.

:class:`TextTail` records each choice's text keys on its replica (all of them: a chunk is
~16 token blocks, so all of a prompt's text keys cost about a quarter of the model's stride
keys over the same tokens) and answers how far past a given depth a replica's run of them
goes.  It only *refines* the model's answer: the caller starts from the model's depth and
looks at most ``stride - 1`` keys further, so what the model evicted (its token LRU) stays
evicted, and the engine's word still gates it all (the window must be held).

Inside a chunk: two prompts that part mid-chunk (a RAG document, then each request's own
question, in one message) share no key there, so the match stops at the chunk before, up to
a chunk (~250 tokens) short of what the engine holds.  Where requests carry their chunks'
*prints* (:func:`~gateway.prefix.blocks.chain_text_keys`), each key also keeps the prints of
the chunk that followed it on that replica (the latest one), and :meth:`fork` counts how many
leading pieces of a request's next chunk agree: resolution ``prefix.fork_bytes`` (~32 tokens),
for the prediction (measured: benchmarks/README.md, "Forks inside a chunk").

Bounded: at most ``max_keys`` (replica, key) entries, least recently recorded first out, and
at most one print string per entry (~60 bytes at 128-byte pieces).  A replica's clear
(``AllBlocksCleared``, a restart) retires its entries at once (an epoch per replica, checked
on lookup).  Not thread-safe: the policy's event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_MAX_KEYS = 200_000  # (replica, key) entries: ~40 MB at most (tuple, ints, dict slot)


class TextTail:
    """(replica, text key) → the replica's epoch when recorded, in LRU order."""

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._keys: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._next: dict[tuple[str, int], bytes] = {}  # entry -> prints of the chunk that followed it
        self._epoch: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def prints(self) -> int:
        """Entries keeping the prints of the chunk that followed them."""
        return len(self._next)

    def record(self, name: str, keys: Sequence[int], prints: Sequence[bytes] = (), after: int | None = None) -> None:
        """``name`` was chosen for a prompt whose text keys (past the window) are ``keys``; with
        ``prints`` (one per key), each key's chunk prints are kept under the key before it
        (``after``, the last token block's key, for the first)."""
        if self.max_keys <= 0 or not keys:
            return
        epoch = self._epoch.get(name, 0)
        table = self._keys
        follows = self._next
        before: tuple[str, int] | None = None
        if prints and after is not None:
            before = (name, after)
            table[before] = epoch
            table.move_to_end(before)
        for i, key in enumerate(keys):
            if before is not None:
                mark = prints[i] if i < len(prints) else b""
                if mark:
                    follows[before] = mark
                else:
                    follows.pop(before, None)
            entry = (name, key)
            table[entry] = epoch
            table.move_to_end(entry)
            before = entry if prints else None
        while len(table) > self.max_keys:
            follows.pop(table.popitem(last=False)[0], None)

    def fork(self, name: str, after: int, prints: bytes) -> int:
        """How many leading pieces of a chunk with these ``prints`` agree with the chunk that
        followed key ``after`` on ``name`` (0: none known)."""
        entry = (name, after)
        if not prints or self._keys.get(entry) != self._epoch.get(name, 0):
            return 0
        mark = self._next.get(entry)
        if not mark:
            return 0
        size = min(len(mark), len(prints))
        if mark[:size] == prints[:size]:
            return size // 4
        pieces = 0
        while mark[4 * pieces : 4 * pieces + 4] == prints[4 * pieces : 4 * pieces + 4]:
            pieces += 1
        return pieces

    def extend(self, name: str, keys: Sequence[int], depth: int, most: int) -> int:
        """The deepest ``d`` in ``depth..depth + most`` such that ``name`` recorded every key of
        ``keys[depth:d]`` (1-based depths over ``keys``); ``depth`` if it recorded none of them."""
        table = self._keys
        epoch = self._epoch.get(name, 0)
        end = min(len(keys), depth + most)
        while depth < end and table.get((name, keys[depth])) == epoch:
            depth += 1
        return depth

    def withdraw(self, name: str, keys: Sequence[int], after: int | None = None) -> None:
        """The attempt with these text keys failed on ``name``: it holds none of them (another
        request's record of the same keys there goes too: an under-credit, never an over-credit),
        nor the first one's chunk after ``after``."""
        table = self._keys
        follows = self._next
        if after is not None:
            follows.pop((name, after), None)
        for key in keys:
            entry = (name, key)
            table.pop(entry, None)
            follows.pop(entry, None)

    def forget(self, name: str) -> None:
        """``name``'s cache was cleared: its entries say nothing now (they age out of the LRU).

        Its prints go at once: an entry recorded again after the clear by a prompt that ends
        there (no chunk after it) would otherwise find the old chunk's prints under it, and
        credit a later prompt with text the engine no longer holds.  A clear is rare (a reset,
        a restart), so one pass over the prints is fine."""
        self._epoch[name] = self._epoch.get(name, 0) + 1
        if any(entry[0] == name for entry in self._next):
            self._next = {entry: mark for entry, mark in self._next.items() if entry[0] != name}
