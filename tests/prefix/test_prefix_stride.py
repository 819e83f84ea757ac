"""The affinity index stores a key every ``affinity_stride_tokens`` of prompt: its stride in
blocks follows the route's block size, so engines with 128-token blocks (vLLM's CPU backend) are
matched to the block, not to 512 tokens."""

from __future__ import annotations

import pytest

from gateway.routing.affinity import AffinityIndex
from gateway.routing.base import RequestView
from gateway.routing.policies.prefix import PrefixPolicy
from tests.prefix.policy_helpers import chain, policy, views

DOC = chain(30, 5)  # a document of 30 whole blocks


def _req(keys: tuple[int, ...], block_size: int) -> RequestView:
    return RequestView("x", "route", "m", "chat", None, keys, block_size, len(keys) * block_size + 3)


def _predicted(p: PrefixPolicy, block_size: int) -> int:
    """The prediction for a second prompt behind DOC, once a first one was placed."""
    first = p.choose(_req(DOC + chain(1, 1), block_size), views())
    second = p.choose(_req(DOC + chain(1, 2), block_size), views())
    assert second.replica == first.replica
    return second.detail["predicted_cached_tokens"]


@pytest.mark.parametrize(("block_size", "stride"), [(16, 4), (32, 2), (128, 1), (8, 8), (48, 1), (1, 64)])
def test_the_stride_is_a_span_of_tokens(block_size: int, stride: int) -> None:
    p = policy()
    p.choose(_req(DOC, block_size), views())
    assert p.index.stride == stride
    assert p.index.default_weight == block_size * stride  # a stored key weighs one stride of tokens


def test_a_document_on_128_token_blocks_is_predicted_to_the_block() -> None:
    assert _predicted(policy(), 128) == 30 * 128
    # a fixed stride of 4 blocks matches 512-token steps: the last 2 blocks are not seen
    assert _predicted(policy(affinity_stride_blocks=4), 128) == 28 * 128
    assert _predicted(policy(affinity_stride_tokens=512), 128) == 28 * 128


def test_keys_stored_before_a_shorter_stride_are_still_matched() -> None:
    index = AffinityIndex(max_entries=1000, stride=4)
    index.set_members({"r0": 1.0})
    index.record("r0", DOC)  # every 4th key and the deepest (the 30th)
    index.set_stride(1)
    assert index.match(DOC + chain(2, 9), None) == {"r0": 30}
    assert index.match(DOC[:29] + chain(2, 9), None) == {"r0": 28}  # what was stored: every 4th key
    with pytest.raises(ValueError):
        index.set_stride(0)
