"""Chained block hashes over token ids, the way vLLM keys its prefix cache.

vLLM splits a prompt into fixed-size token blocks and hashes each *full* block together
with its parent block's hash, so block *i*'s key identifies the whole prefix
``tokens[: (i + 1) * block_size]``.  Extra keys (model/LoRA name, ``cache_salt``) go into
the first block, so different models and salted tenants never share a key.

Both the simulator's KV cache and the gateway's router use this one function, so they
agree on what "the same prefix" means.  Keys are xxh3-64 integers: stable across
processes and machines (no Python ``hash()`` randomization).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

# The parent of the first block: a fixed, arbitrary constant (vLLM uses a seed too).
ROOT_KEY = 0x9E3779B97F4A7C15


def first_block_seed(model: str, lora: str | None = None, cache_salt: str | None = None) -> int:
    """Seed for block 0 from the extra keys; ``None`` and ``""`` are the same (no salt/LoRA).

    ``surrogatepass``: the names come from client JSON, where ``"\\ud800"`` is a valid escape
    for a lone surrogate that plain UTF-8 cannot encode.  Valid text encodes exactly as
    before (keys are unchanged); a lone surrogate gets its own distinct bytes instead of
    raising.
    """
    extra = f"{model}\x00{lora or ''}\x00{cache_salt or ''}".encode("utf-8", "surrogatepass")
    return xxhash.xxh3_64_intdigest(extra, seed=ROOT_KEY & 0xFFFFFFFFFFFFFFFF)


def chain_block_keys(
    tokens: Sequence[int],
    block_size: int,
    seed: int,
    max_blocks: int | None = None,
) -> list[int]:
    """Keys of each *full* block of ``tokens`` (a partial tail block gets no key).

    ``seed`` comes from :func:`first_block_seed`.  ``max_blocks`` bounds the work.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    full = len(tokens) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    if full == 0:
        return []
    packed = array("I", tokens[: full * block_size]).tobytes()
    stride = block_size * 4
    keys: list[int] = []
    parent = seed
    hasher = xxhash.xxh3_64_intdigest
    for i in range(full):
        parent = hasher(packed[i * stride : (i + 1) * stride], seed=parent)
        keys.append(parent)
    return keys
