"""Real engine: a route whose block size is set by hand below the engines' own.

``prefix.block_size: 16`` (vLLM's GPU default, as an old config might say) in front of the CPU
engines' 128-token blocks (and 64, after test 4 restarted r1): each engine block is keyed as
several of the route's 16-token keys, so both replicas are matched from their KV events
(precise, ``keyed_at: 16``), and every repeat is predicted exactly, cut to the engine's whole
blocks. Before, such replicas could only be routed by the approximate model. A gateway of its
own beside the lane's default one (both subscribe to the same publishers).
"""

from __future__ import annotations

import pytest

from tests.real_vllm import engine
from tests.real_vllm.lane import ROUTE, Observation, front
from tests.real_vllm.test_lane_2_cache_changes import chat

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]


def test_a_hand_set_finer_block_size_is_matched_from_the_engines_events(real_replicas: list[engine.Replica]) -> None:
    with front(real_replicas, {"routes": [{"name": ROUTE, "prefix": {"block_size": 16}}]}) as f:
        repeats: dict[str, Observation] = {}
        for i in range(16):  # new prompts are placed by load: both replicas soon get one
            body = chat(8801 + 10 * i, words=700 + 53 * i)
            first = f.send(f"fine-{i}", "chat", body)
            f.settle_events(first.replica)
            again = f.send(f"fine-{i}-again", "chat", body)
            assert again.cached_tokens, f"vLLM cached the prompt on {again.replica}"
            assert again.agrees, (
                f"{again.replica}: predicted {again.predicted}, vLLM {again.cached_tokens} of "
                f"{again.prompt_tokens}; events: {f.kv_row(again.replica)}"
            )
            repeats[again.replica] = again
            if len(repeats) == len(f.replicas):
                break
        assert set(repeats) == set(f.replicas), f"both replicas served a repeat: {sorted(repeats)}"
        rows = f.stats()["kv_events"]["replicas"]
        keyed = {name: (row["mode"], row["keyed_at"], row["block_size"] % 16) for name, row in rows.items()}
        assert keyed == {name: ("precise", 16, 0) for name in f.replicas}, keyed
        modes = {name: tally.get("kv_mode") for name, tally in f.tallies().items()}
        assert modes == {name: "precise" for name in f.replicas}, modes
