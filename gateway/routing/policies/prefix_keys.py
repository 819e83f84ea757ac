"""A request's keys as the ``prefix`` policy reads them: the ring key, and the tokens they cover.

A key names a whole prefix; the policy needs that prefix's length in tokens (cached tokens
are what it weighs).  Keys over the token window count ``block_size`` each, keys continuing
the chain over the prompt's text carry their own estimate (``RequestView.key_tokens``), and
a prompt running past every key is known only by its estimated total.  Pure functions of the
request (and two settings): the decision and the affinity index's record both use them.
"""

from __future__ import annotations

import xxhash

from gateway.routing.base import RequestView


def token_blocks(request: RequestView) -> int:
    """How many of the request's keys are whole token blocks (the rest continue over its text)."""
    return len(request.block_keys) if request.token_blocks is None else request.token_blocks


def depth_tokens(request: RequestView, depth: int) -> int:
    """Prompt tokens covered by the request's first ``depth`` keys.

    Token blocks count ``block_size`` each; keys past them (the chain continued over
    the prompt's text) carry their own estimate in ``request.key_tokens``.
    """
    block_size = request.block_size or 1
    blocks = token_blocks(request)
    if depth <= blocks:
        return depth * block_size
    extra = request.key_tokens
    i = depth - blocks - 1
    return extra[i] if i < len(extra) else depth * block_size


def beyond_window(request: RequestView) -> int | None:
    """The whole prompt's length when it runs past what the keys cover, else None."""
    total = request.prompt_tokens_estimate
    if not total:
        return None
    keyed = depth_tokens(request, len(request.block_keys))
    return total if total > keyed + (request.block_size or 1) else None


def ring_key_of(request: RequestView, use_session_key: bool, key_depth_tokens: int) -> tuple[int | None, str, int]:
    """``(key, source, depth)``: where the request starts on the ring — its session header's
    hash (``use_session_key``), else the chain key at ``key_depth_tokens`` (or the deepest),
    else ``(None, "none", 0)`` (no keys: the fallback)."""
    keys = request.block_keys
    if use_session_key and request.session_key:
        return xxhash.xxh3_64_intdigest(request.session_key.encode()), "session", 0
    if keys:
        depth = max(1, min(len(keys), key_depth_tokens // (request.block_size or 1)))
        return keys[depth - 1], "block", depth
    return None, "none", 0
