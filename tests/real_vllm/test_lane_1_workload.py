"""Real engine, default gateway: predicted cached tokens equal vLLM's on a mixed workload.

Issue 23's bar: on >= 100 requests (chat and completions, streaming and not, multi-turn
conversations with 1-4k-token system prompts, one pasting special-token text, tools and a tool
call), the gateway's prediction equals vLLM's ``cached_tokens`` on >= 99 %. Conversations are
interleaved turn by turn, each turn carrying the engine's own earlier replies, as clients do.
"""

from __future__ import annotations

import pytest

from tests.real_vllm import workload
from tests.real_vllm.lane import Front, summary

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]  # replica starts take minutes
SCALE = 6  # 6 copies of the conversation set with new seeds: 110 requests


def test_predictions_equal_vllm_on_the_mixed_workload(real_front: Front) -> None:
    conversations = workload.conversations(SCALE)
    pending = [(c, c.turns()) for c in conversations]
    observed = []
    turn = 0
    while pending:
        still = []
        for conv, turns in pending:
            body = next(turns, None)
            if body is None:
                continue
            obs = real_front.send(f"{conv.name}-t{turn}", "chat", body)
            conv.answer(obs.content)
            observed.append(obs)
            still.append((conv, turns))
        pending = still
        turn += 1
    for i, body in enumerate(workload.tool_call_turns()):
        observed.append(real_front.send(f"toolcall-t{i}", "chat", body))
    for i, body in enumerate(workload.completions(SCALE)):
        observed.append(real_front.send(f"completion-{i}", "completions", body))
    print(summary(observed))
    assert len(observed) >= 100
    assert any(o.cached_tokens for o in observed), "the workload reuses prefixes"
    assert {o.replica for o in observed} == set(real_front.replicas), "both replicas served"
    agree = sum(o.agrees for o in observed)
    assert agree >= 0.99 * len(observed), summary(observed)
