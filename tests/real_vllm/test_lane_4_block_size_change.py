"""Real engine: a replica redeployed with another ``--block-size``, without restarting the gateway.

The route hashes its replicas' own block size (``block_size: auto``, scraped from
``vllm:cache_config_info``). A replica restarted with ``--block-size 64`` beside one at 128 makes
the fleet disagree: the route follows (64, which 128 is a multiple of) and says which replica uses which
size, and each prediction still equals what vLLM reports, both replicas matched from their KV
events (precise): the one at 128 has each of its blocks keyed as two of the route's 64-token
keys, its predictions cut to whole 128-token blocks as its engine caches them; each prediction's
units label names the engine it went to. Runs after tests 1-3 (a replica restart, about a minute;
the replica keeps its new size, which test 5 accepts).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.polling import wait_for
from tests.real_vllm import engine
from tests.real_vllm.lane import Front, Observation
from tests.real_vllm.test_lane_2_cache_changes import chat

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]  # replica starts take minutes
NEW_SIZE = 64
SIZES = {"r0": 128, "r1": NEW_SIZE}


def _block(front: Front) -> dict[str, Any]:
    return front.route().get("block_size") or {}


def test_a_replica_restarted_with_another_block_size_is_still_predicted_exactly(
    real_front: Front, real_engine: engine.Engine
) -> None:
    replica = real_front.replicas["r1"]
    replica.extra_args = [*replica.extra_args, "--block-size", str(NEW_SIZE)]
    real_engine.restart(replica)
    real_front.wait_healthy("r1", timeout=120)
    real_front.poke("r1")
    wait_for(lambda: _block(real_front).get("engines") == SIZES, 60, 0.2, "the gateway to scrape the new block size")
    block = _block(real_front)
    assert block["size"] == NEW_SIZE and block["disagree"] and block["mismatched"] == ["r0"], block

    # new prompts are placed by load, so both replicas soon get one. The one at 128 must also
    # get a prompt whose hit ends inside one of its blocks at the route's 64 (a whole number of
    # 64s but not of 128s), where a prediction at the route's granularity is one block over.
    repeats: dict[str, Observation] = {}
    telling = None
    for i in range(16):
        body = chat(7401 + 10 * i, words=900 + 37 * i)
        first = real_front.send(f"size-{i}", "chat", body)
        real_front.settle_events(first.replica)
        again = real_front.send(f"size-{i}-again", "chat", body)
        assert again.cached_tokens, f"vLLM cached the prompt on {again.replica}"
        assert again.cached_tokens % SIZES[again.replica] == 0
        assert again.agrees, (
            f"{again.replica} at {SIZES[again.replica]}-token blocks: predicted {again.predicted}, "
            f"vLLM {again.cached_tokens} of {again.prompt_tokens}; events: {real_front.kv_row(again.replica)}"
        )
        repeats[again.replica] = again
        if again.replica == "r0" and (again.prompt_tokens - 1) // NEW_SIZE % 2:
            telling = again
        if len(repeats) == len(SIZES) and telling is not None:
            break
    assert set(repeats) == set(SIZES), f"both replicas served a repeat: {sorted(repeats)}"
    assert telling is not None, "no repeat on r0 ended inside one of its 128-token blocks"
    tallies = real_front.tallies()
    modes = {name: tally.get("kv_mode") for name, tally in tallies.items()}
    assert modes == {"r0": "precise", "r1": "precise"}, modes  # r0's 128-token blocks keyed at 64
    # each prediction is labelled for its engine: r1 at the route's size exact (as it was all
    # along), r0's blocks named as not the keys' (its tally also holds the earlier tests' exact ones)
    assert tallies["r1"]["predicted_units"] == "exact (llama3)", tallies["r1"]
    assert "block size 64 vs engine 128" in tallies["r0"]["predicted_units"], tallies["r0"]
