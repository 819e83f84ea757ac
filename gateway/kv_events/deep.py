"""How far past the token window one engine holds each prefix: its blocks there, by depth alone.

The precise index keys blocks only inside the largest route window (requests key text chunks
past it, which no event's token ids reproduce), so past the window the router's match is the
affinity model's and the text tail's record of what the gateway *sent* a replica.  The engine
says what it still *holds* there too: its ``BlockStored`` events chain past the window and its
``BlockRemoved`` events name those blocks when it evicts them.  This keeps, per replica, each
such block by the window's last key it hangs under (its *anchor*) and its depth past it, and
answers "how many blocks past this anchor does the engine hold along its deepest chain" —
an upper bound on what a request ending its window at that anchor can hit there.

Measured (``bench_virtual.py``, Mooncake synthetic trace at saturation, 7 samples, shipped
row): of the 1.29 % prediction error, 0.51 points were content past the window that the engine
had already evicted when the request was placed, which the router credited from its records.

Only the deepest depth is kept per anchor, not which continuation it is (two requests sharing
a window may part past it): a bound, never a match.  Costs one dict entry per block past the
window (see :data:`DEEP_BYTES`), inside the index's byte bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: bytes one block past the window costs at most: its engine-hash entry (dict slot, a 3-item list)
#: and its share of its anchor's depth counts
DEEP_BYTES = 200

_ANCHOR, _DEPTH, _COPIES = 0, 1, 2


@dataclass(slots=True)
class DeepBlocks:
    """One replica's blocks past the window: engine hash -> [anchor key, depth past it, copies]."""

    blocks: dict[int | bytes, list[int]] = field(default_factory=dict)
    depths: dict[int, dict[int, int]] = field(default_factory=dict)  # anchor -> depth -> blocks held there
    deepest: dict[int, int] = field(default_factory=dict)  # anchor -> its deepest depth held

    def __len__(self) -> int:
        return len(self.blocks)

    def parent(self, block: int | bytes) -> tuple[int, int] | None:
        """(anchor, depth) of a block past the window, to chain the next event's blocks from."""
        entry = self.blocks.get(block)
        return None if entry is None else (entry[_ANCHOR], entry[_DEPTH])

    def store(self, anchor: int, depth: int, hashes: Sequence[int | bytes]) -> int:
        """Blocks ``hashes`` stored at depths ``depth + 1``... under ``anchor``; returns how many are new."""
        if not hashes:
            return 0
        blocks = self.blocks
        counts = self.depths.get(anchor)
        if counts is None:
            counts = self.depths[anchor] = {}
        added = 0
        for i, block in enumerate(hashes):
            entry = blocks.get(block)
            if entry is not None:
                entry[_COPIES] += 1
                continue
            at = depth + i + 1
            blocks[block] = [anchor, at, 1]
            counts[at] = counts.get(at, 0) + 1
            added += 1
        if counts:
            self.deepest[anchor] = max(self.deepest.get(anchor, 0), depth + len(hashes))
        return added

    def remove(self, block: int | bytes) -> bool | None:
        """The engine evicted ``block``: True when its last copy went, False when copies remain,
        None when it is not a block past the window."""
        entry = self.blocks.get(block)
        if entry is None:
            return None
        entry[_COPIES] -= 1
        if entry[_COPIES] > 0:
            return False
        del self.blocks[block]
        anchor, depth = entry[_ANCHOR], entry[_DEPTH]
        counts = self.depths[anchor]
        left = counts[depth] - 1
        if left:
            counts[depth] = left
            return True
        del counts[depth]
        if not counts:
            del self.depths[anchor]
            self.deepest.pop(anchor, None)
        elif depth >= self.deepest.get(anchor, 0):
            self.deepest[anchor] = max(counts)  # the tail went (vLLM frees tail first): rare, O(depths)
        return True

    def reach(self, anchor: int) -> int:
        """Blocks past ``anchor`` the engine holds along its deepest chain (0: none)."""
        return self.deepest.get(anchor, 0)

    def clear(self) -> int:
        """Forget everything; returns how many blocks were held."""
        held = len(self.blocks)
        self.blocks = {}
        self.depths = {}
        self.deepest = {}
        return held
