"""Which block size a route hashes with: ``prefix.block_size: auto | N``.

A routing key predicts a replica's cache only when it covers the same tokens as one of the
engine's blocks.  vLLM's block size depends on the backend (16 on GPUs by default, 128 on
its CPU backend, any ``--block-size``) and every engine publishes it in
``vllm:cache_config_info``, which the gateway scrapes.  So by default (``auto``) a route
follows its replicas:

- no replica has published a block size yet: 16 (vLLM's GPU default);
- all that published agree: that size;
- they disagree: the largest size every one of theirs is a multiple of (their greatest
  common divisor: 32 for 32 and 128, 16 for 48 and 64), unless that is under 16 tokens; then
  the most common size (ties: the smallest).  The route says which replicas use which size
  (stats, explain and the doctor).  A replica at a multiple of the route's size has its
  engine's blocks keyed at the route's (``PreciseIndex.key_at``), so it is still matched from
  its KV events, its predictions cut to whole blocks of its own size
  (``gateway.routing.policies.prefix``): with the common divisor, that is every replica.  A
  replica at any other size is routed by the approximate model (the gateway's own record of
  what it sent there).  Both are labelled with the mismatch (``PrefixPipeline.units_on``).
  Why not the most common size first: keys at 128 over an engine at 32 under-predict it by up
  to 96 tokens and cannot match its events; keys at 32 over an engine at 128 cost four keys
  per engine block and lose nothing.

An integer setting always wins (``source: config``); the engines' sizes are still shown so
a mismatch is visible.  Changing size changes every key, so keys learned at the old size
simply never match again (they age out of the bounded indexes): no request is predicted
from a block it does not share.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

AUTO = "auto"
DEFAULT_BLOCK_SIZE = 16  # vLLM's default on GPUs: what a route hashes before any engine said otherwise

Source = Literal["config", "engines", "default"]


@dataclass(frozen=True, slots=True)
class BlockSizeChoice:
    """The block size a route hashes with now, and why."""

    size: int
    setting: int | str  # the configured value: an integer or "auto"
    source: Source  # config: the setting; engines: the replicas' scraped size; default: none known yet
    engines: Mapping[str, int] = field(default_factory=dict)  # replica -> its scraped block size

    @property
    def disagree(self) -> bool:
        """The route's replicas do not all use one block size."""
        return len(set(self.engines.values())) > 1

    @property
    def mismatched(self) -> dict[str, int]:
        """Replicas whose engine uses another block size than the route hashes with."""
        return {name: size for name, size in self.engines.items() if size != self.size}

    def engine_sizes(self) -> dict[int, list[str]]:
        """block size -> the replicas using it (sorted), for people."""
        out: dict[int, list[str]] = {}
        for name, size in sorted(self.engines.items()):
            out.setdefault(size, []).append(name)
        return dict(sorted(out.items()))

    def describe(self) -> str | None:
        """One sentence when something is off (replicas disagree or differ from the route), else None."""
        if not self.engines:
            return None
        groups = "; ".join(f"{size}: {', '.join(names)}" for size, names in self.engine_sizes().items())
        if self.disagree:
            if self.source == "config":
                how = "configured"
            elif all(size % self.size == 0 for size in self.engines.values()):
                how = "every replica's is a multiple of it"
            else:
                how = "the most common"
            return (
                f"the replicas use different block sizes ({groups}); the route hashes {self.size}-token blocks ({how})"
            )
        if self.mismatched:
            return f"the engines use block size {groups}; the route hashes {self.size}-token blocks (configured)"
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "setting": self.setting,
            "source": self.source,
            "engines": dict(sorted(self.engines.items())),
            "disagree": self.disagree,
            "mismatched": sorted(self.mismatched),
            "note": self.describe(),
        }


def choose(setting: int | str, engines: Mapping[str, int]) -> BlockSizeChoice:
    """The block size for ``setting`` given each replica's scraped block size (see the module doc)."""
    known = {name: size for name, size in engines.items() if isinstance(size, int) and size > 0}
    if isinstance(setting, int):
        return BlockSizeChoice(setting, setting, "config", known)
    if not known:
        return BlockSizeChoice(DEFAULT_BLOCK_SIZE, setting, "default", known)
    common = math.gcd(*known.values())
    if common < DEFAULT_BLOCK_SIZE:  # e.g. 24 and 32: keys of 8 tokens would cost 4x the default's
        counts = Counter(known.values())
        common = min(counts, key=lambda s: (-counts[s], s))
    return BlockSizeChoice(common, setting, "engines", known)


def validate_setting(value: Any) -> int | str:
    """Config-time check of ``prefix.block_size``: ``auto`` or a positive integer."""
    if value == AUTO:
        return AUTO
    if isinstance(value, bool):
        raise ValueError("block_size must be 'auto' or a positive integer")
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and value >= 1:
        return value
    raise ValueError("block_size must be 'auto' or a positive integer (vLLM's --block-size)")
