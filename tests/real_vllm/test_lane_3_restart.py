"""Real engine: a replica killed and restarted (same address) without restarting the gateway.

The engine comes back empty and its KV event sequence starts at 0 again (with its first scheduler
step: an idle engine publishes nothing, so the test pokes it once, as other traffic would); the
gateway must notice both by itself: the replica is back in precise mode (routed from its events)
and the next prediction equals what vLLM reports. Runs last (it costs a replica start, about a
minute).
"""

from __future__ import annotations

import pytest

from tests.polling import wait_for
from tests.real_vllm import engine
from tests.real_vllm.lane import Front
from tests.real_vllm.test_lane_2_cache_changes import chat, warm

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]  # replica starts take minutes


def test_a_killed_and_restarted_replica_is_predicted_exactly_and_back_in_precise_mode(
    real_front: Front, real_engine: engine.Engine
) -> None:
    body = chat(7301)
    where = warm(real_front, "restart", body).replica
    replica = real_front.replicas[where]
    replica.kill()
    real_engine.restart(replica)
    real_front.wait_healthy(where, timeout=120)
    # its events start again at sequence 0, with its first step (poked: the fleet is idle here);
    # the gateway follows them without a restart of its own
    real_front.poke(where)
    wait_for(lambda: real_front.mode(where) == "precise", 60, 0.2, f"{where} back in precise mode")
    real_front.settle_events(where)
    after = real_front.send("restart-after", "chat", body)
    if after.replica == where:
        assert after.cached_tokens == 0, "a restarted engine starts empty"
    assert after.predicted == after.cached_tokens, (
        f"after a restart: predicted {after.predicted}, vLLM {after.cached_tokens} on {after.replica}; "
        f"events: {real_front.kv_row(where)}"
    )
    real_front.settle_events(after.replica)
    again = real_front.send("restart-again", "chat", body)
    assert again.agrees, f"the replica's cache relearned: predicted {again.predicted}, vLLM {again.cached_tokens}"
