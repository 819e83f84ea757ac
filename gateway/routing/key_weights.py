"""What a stored key weighs in a replica's modelled KV cache, in prompt tokens.

The affinity index (:mod:`gateway.routing.affinity`) models a replica whose cache size is
known as an LRU of *tokens*: each stored key weighs the prompt tokens it adds after the
stored key before it, so a 32k-token prompt's sparse text keys (~1,000 tokens each) weigh
what the engine really holds instead of 64 tokens like the keys of the token window.  Most
keys are a stride of whole token blocks and weigh the standard weight; only the others (the
deepest, text keys) are computed, and only when new.  A record shared with other gateway
processes carries those explicit weights, so peers' models fill as the sender's does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KeyWeights:
    """What the stored keys of one record weigh in a modelled KV cache (deepest first): the
    first ``special`` by ``weight_of(position)``, the rest the standard weight (a stride of
    whole token blocks) — most keys of a long prompt, which so cost no call."""

    weight_of: Callable[[int], int]
    special: int

    def explicit(self, count: int) -> list[int]:
        """The weights of the first ``count`` stored keys that are not the standard one, as a
        list (a record shared with other gateway processes carries them; the rest weigh the
        standard weight there too)."""
        return [self.weight_of(i) for i in range(min(self.special, count))]

    @classmethod
    def of(cls, values: Sequence[int] | None) -> KeyWeights | None:
        """Weights given as a list (a peer's record, a snapshot): position i weighs
        ``values[i]``, positions past the list the standard weight; None for none."""
        if not values:
            return None
        return cls(values.__getitem__, len(values))


def stride_weights(
    stride: int,
    standard: int,
    depth: int,
    tokens_at: Callable[[int], int],
    prompt_tokens: int | None = None,
    blocks: tuple[int, int] = (0, 0),
) -> KeyWeights:
    """The weight of each key an index with this ``stride`` stores for a prompt of ``depth``
    keys, by its position there (deepest first): the tokens it adds after the stored key
    before it; the deepest also carries the prompt past its keys (``prompt_tokens``).
    ``standard``: the index's default weight.  ``blocks`` = (token blocks, block size): the
    keys that far are whole token blocks, so the stride keys among them weigh the standard
    weight without a call (a cold 32k-token prompt: ~90 new keys, 60 of them there); only the
    others are asked for, and only when new.
    """
    last = depth // stride  # stored stride keys; one more when the deepest is not one
    offset = 1 if depth % stride else 0
    token_blocks, block_size = blocks

    def weight_of(i: int) -> int:
        at = depth if i == 0 else (last - i + offset) * stride
        before = (at - 1) // stride * stride
        if at <= token_blocks:
            weight = (at - before) * block_size
        else:
            weight = max(1, tokens_at(at) - (tokens_at(before) if before else 0))
        if i == 0 and prompt_tokens:
            weight += max(0, prompt_tokens - tokens_at(depth))
        return weight

    # the deepest, and the stride keys past the whole blocks (text keys), need weight_of
    special = depth
    if block_size * stride == standard:
        special = offset + max(0, last - token_blocks // stride)
    return KeyWeights(weight_of, max(1, special))


def even_weights(standard: int, stored: int, prompt_tokens: int | None) -> KeyWeights:
    """Weights without the prompt's token positions (a record from an older peer):
    ``standard`` per stored key, and the deepest carries whatever of ``prompt_tokens`` the
    others do not cover."""
    deepest = max(standard, (prompt_tokens or 0) - standard * (stored - 1))
    return KeyWeights(lambda i: deepest if i == 0 else standard, 1)
