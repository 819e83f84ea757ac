"""A KV cache model for the state tests' indexes: what ``replica_cache_tokens`` sets up."""

from __future__ import annotations

from gateway.routing.affinity import AffinityIndex


def model_kv(index: AffinityIndex, tokens: int, names: list[str]) -> AffinityIndex:
    """``index`` with each of ``names``' prefix caches modelled at ``tokens`` tokens; a stored
    key weighs a stride of 4 blocks of 16 tokens unless its record says otherwise."""
    index.default_weight = 64
    for name in names:
        index.set_token_capacity(name, tokens)
    return index
