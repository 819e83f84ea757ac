"""A prompt estimated past its model's ``max_model_len`` is placed but recorded nowhere: its
engine answers 400, and a record taken back then returns only the keys it added, not the older
records it pushed out of the replica's modelled cache."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.routing.base import ReplicaView, RequestView
from gateway.routing.policies.prefix import PrefixPolicy, PrefixPolicySettings
from tests.prefix.policy_helpers import NAMES, chain, req

CACHE_TOKENS = 64 * 16  # each replica's modelled prefix cache: 64 blocks


def _views() -> list[ReplicaView]:
    return [ReplicaView(n, kv_cache_tokens=CACHE_TOKENS) for n in NAMES]


def _policy() -> PrefixPolicy:
    return PrefixPolicy(PrefixPolicySettings(affinity_stride_blocks=1), _views())


def _huge(limit: int | None) -> RequestView:
    """A 90-block prompt (1,443 tokens) in the same session as the conversation: its turn grew
    past the context (and past the modelled cache, which its record would empty)."""
    return replace(req(chain(90, 7), session="a", rid="huge"), context_limit=limit)


@pytest.mark.parametrize("limit", [1000, None])
def test_a_prompt_over_the_context_pushes_no_record_out(limit: int | None) -> None:
    p = _policy()
    history = chain(30, 1)
    first = p.choose(req(history, session="a"), _views())
    home = first.replica

    huge = _huge(limit)
    decision = p.choose(huge, _views())
    assert decision.replica == home  # placed as any other request: the gateway does not refuse on an estimate
    assert decision.detail.get("over_context", False) is (limit is not None)
    p.forget_attempt(huge, decision)  # the engine's 400

    nxt = p.choose(req(history + chain(2, 2), session="a", rid="next"), _views())
    if limit is not None:
        # the conversation's history is still credited where it is
        assert nxt.replica == home
        assert nxt.detail["predicted_cached_tokens"] == 30 * 16
        assert not p.index.holds(home, huge.block_keys[-1])
    else:
        # without the model's max_model_len the record pushed the history out, and taking it
        # back did not bring it back
        assert nxt.detail["predicted_cached_tokens"] < 30 * 16


def test_a_prompt_within_the_context_is_recorded() -> None:
    p = _policy()
    within = replace(req(chain(20, 3), rid="w"), context_limit=20 * 16 + 3)  # exactly at the limit: fits
    decision = p.choose(within, _views())
    assert "over_context" not in decision.detail
    assert p.index.holds(decision.replica, within.block_keys[-1])


def test_explain_shows_a_prompt_over_the_context() -> None:
    p = _policy()
    decision = p.peek(_huge(1000), _views())
    assert decision.detail["over_context"] is True
    assert len(p.index) == 0  # explain records nothing, as always
