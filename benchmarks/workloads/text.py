"""Deterministic filler text whose token count is known exactly.

The pool holds cl100k tokens that decode to a space followed by a lowercase ASCII word.
Each such word is its own BPE pre-token and a whole token, so a text made of them encodes
back to exactly the ids it was made from: N words = N tokens, and no merge crosses a word
or message boundary.  That lets the synthetic workload size prompts in tokens without
tokenizing anything at generation time.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cache

import numpy as np

from benchmarks.workloads import BenchRequest
from gateway.tokens.tokenizer import get_tokenizer

# Search only ordinary ids (well clear of the special tokens at the top of the vocabulary).
_ID_RANGE = range(256, 100_000)


@cache
def word_pool() -> tuple[int, ...]:
    """Token ids that decode to `` word`` (3-10 lowercase ASCII letters) and re-encode to themselves."""
    tok = get_tokenizer("cl100k_base")
    pool: list[int] = []
    for token_id in _ID_RANGE:
        try:
            text = tok.decode([token_id])
        except Exception:  # gaps in the vocabulary
            continue
        word = text[1:]
        if (
            text.startswith(" ")
            and 3 <= len(word) <= 10
            and word.isascii()
            and word.isalpha()
            and word.islower()
            and tok.encode(text) == [token_id]
        ):
            pool.append(token_id)
    return tuple(pool)


@cache
def _decoded_pool() -> tuple[str, ...]:
    tok = get_tokenizer("cl100k_base")
    return tuple(tok.decode([i]) for i in word_pool())


@cache
def _text_of_id() -> dict[int, str]:
    return dict(zip(word_pool(), _decoded_pool(), strict=True))


def decode(ids: Sequence[int]) -> str:
    """The text of pool ids (each `` word``); it encodes back to exactly ``ids`` under cl100k."""
    table = _text_of_id()
    return "".join(table[i] for i in ids)


def random_ids(rng: np.random.Generator, n: int) -> list[int]:
    """``n`` pool ids drawn uniformly from ``rng`` (``n`` tokens under cl100k)."""
    pool = word_pool()
    return [pool[k] for k in rng.integers(0, len(pool), size=n).tolist()]


def completion_request(t: float, ids: Sequence[int], max_tokens: int, session: str, kind: str) -> BenchRequest:
    """A ``/v1/completions`` request whose prompt is the text of pool ``ids`` (exactly that many tokens)."""
    return BenchRequest(
        t=t,
        endpoint="completions",
        body={"prompt": decode(ids)},
        max_tokens=max_tokens,
        prompt_tokens=len(ids),
        session=session,
        kind=kind,
    )


def words(rng: random.Random, n: int) -> str:
    """``n`` random pool words (``n`` tokens under cl100k), each with its leading space."""
    pool = _decoded_pool()
    return "".join(rng.choice(pool) for _ in range(max(0, n)))
