"""A tokenizer wrapper that remembers long texts it has encoded (bounded LRU).

Real traffic repeats the same long system prompts, tool lists and documents; that is the
whole point of prefix caching.  The chat template tokenizes message by message, so caching
per text turns the dominant cost of a long-prompt request (BPE over thousands of tokens)
into a dictionary lookup, and keeps one simulator process far ahead of the gateway.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...


MIN_CACHED_CHARS = 256  # short texts are cheaper to encode than to look up and store


class CachingTokenizer:
    """Same interface as the wrapped tokenizer; returns fresh lists to callers."""

    def __init__(self, inner: Tokenizer, max_chars: int = 32 * 1024 * 1024) -> None:
        self.inner = inner
        self.name = inner.name
        self.max_chars = max_chars
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self.hits = 0
        self.misses = 0

    def encode(self, text: str) -> list[int]:
        if len(text) < MIN_CACHED_CHARS:
            return self.inner.encode(text)
        cache = self._cache
        tokens = cache.get(text)
        if tokens is not None:
            cache.move_to_end(text)
            self.hits += 1
            return list(tokens)
        self.misses += 1
        fresh = self.inner.encode(text)
        if len(text) <= self.max_chars // 4:
            cache[text] = tuple(fresh)
            self._chars += len(text)
            while self._chars > self.max_chars:
                old, _ = cache.popitem(last=False)
                self._chars -= len(old)
        return fresh

    def decode(self, tokens: list[int]) -> str:
        return self.inner.decode(tokens)
