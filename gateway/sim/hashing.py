"""The simulated engine's own prefix-cache block hashing (vLLM-like, not the gateway's code).

As in vLLM: a prompt is cut into full blocks of ``block_size`` tokens, each block's hash
covers its parent's hash, its token ids and, in block 0, the extra keys (model / LoRA name and
``cache_salt``) so different models and salted tenants never share a block.  The constants
and byte layout differ from the gateway's keys on purpose: the router must predict *which
replica* holds a prefix, never reproduce the engine's internal hashes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

_NONE_HASH = 0x5EED_0F_C0FFEE  # the parent of block 0 (vLLM seeds it too)


def block_seed(model: str, lora: str | None, cache_salt: str | None) -> int:
    """The extra keys of block 0 folded into its parent hash."""
    extra = "\x1f".join((model, lora or "", cache_salt or "")).encode("utf-8", "surrogatepass")
    return xxhash.xxh3_64_intdigest(extra, seed=_NONE_HASH)


def block_hashes(tokens: Sequence[int], block_size: int, seed: int) -> list[int]:
    """One hash per *full* block; block i's hash names the whole prefix ``tokens[:(i+1)*block_size]``."""
    full = len(tokens) // block_size
    if full == 0:
        return []
    try:
        data = array("I", tokens[: full * block_size]).tobytes()
    except OverflowError:  # ids past 2**32 (validated elsewhere; never crash the engine)
        data = array("Q", tokens[: full * block_size]).tobytes()
    stride = len(data) // full
    out: list[int] = []
    parent = seed
    digest = xxhash.xxh3_64_intdigest
    for i in range(full):
        parent = digest(parent.to_bytes(8, "little") + data[i * stride : (i + 1) * stride])
        out.append(parent)
    return out
