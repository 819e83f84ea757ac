"""The hit rate a prefix cache would see for a sequence of requests: an LRU of blocks, replayed.

Pooled (one cache for the whole route): a prefix router's job is to make the fleet behave
like one cache, so this is what the route can reach; the gap to the reported rate is
routing's.  Hits follow vLLM's counting — the longest run of cached leading blocks, capped
one token short of the prompt (vLLM computes at least the last token), in whole blocks.
A tenant salt changes every key of a chain, so a salted chain lives in the salt's namespace.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Request:
    """One request to replay: its salt namespace, unsalted chain, prompt length and block size."""

    namespace: Hashable
    keys: Sequence[Hashable]
    prompt_tokens: int
    block_size: int


@dataclass(frozen=True, slots=True)
class HitRate:
    cached_tokens: int
    prompt_tokens: int
    requests: int

    @property
    def rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay(requests: Iterable[Request], capacity_blocks: int | None = None) -> HitRate:
    """Feed ``requests`` in order through an LRU of ``capacity_blocks`` blocks (None: unbounded)."""
    cache: OrderedDict[tuple[Hashable, Hashable], None] = OrderedDict()
    cached = prompt = count = 0
    for req in requests:
        count += 1
        prompt += req.prompt_tokens
        limit = max(req.prompt_tokens - 1, 0) // req.block_size if req.block_size > 0 else 0
        hit = 0
        for key in req.keys[:limit]:
            if (req.namespace, key) not in cache:
                break
            hit += 1
        cached += hit * req.block_size
        for key in req.keys:
            entry = (req.namespace, key)
            if entry in cache:
                cache.move_to_end(entry)
            else:
                cache[entry] = None
        if capacity_blocks is not None:
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return HitRate(cached, prompt, count)
