"""Real engine: the engine's cache changes behind the gateway's back, and the next prediction follows.

``POST /reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE=1``) empties a replica's cache; a flood of
distinct prompts sent straight to a replica evicts what the gateway saw it store (the fleet's
replicas hold 512 blocks of 128 tokens, conftest.py). The gateway is told neither by a response;
only the engine's KV events (AllBlocksCleared, BlockRemoved) say so. After each, the same
request again must be predicted exactly as vLLM then reports it.

vLLM 0.32 publishes a reset's AllBlocksCleared with its *next* scheduler step, never while idle
(recorded: tests/fixtures/real_vllm/README.md), so no gateway can know of a reset on an idle
engine before the next request there runs; the test pokes each replica once (what other traffic
does on a busy fleet) and then asks for the next prediction.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.real_vllm import workload
from tests.real_vllm.conftest import FLEET_BLOCKS
from tests.real_vllm.lane import Front, Observation

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]  # replica starts take minutes
BLOCK = 128


def chat(seed: int, words: int = 1500) -> dict:
    return {
        "model": workload.MODEL,
        "messages": [
            {"role": "system", "content": workload.text(words, seed)},
            {"role": "user", "content": workload.text(40, seed + 1)},
        ],
        "max_tokens": 4,
        "temperature": 0,
    }


def warm(front: Front, rid: str, body: dict) -> Observation:
    """Send twice: the second is a hit the gateway predicted (or the test says so)."""
    front.send(rid + "-first", "chat", body)
    again = front.send(rid + "-again", "chat", body)
    assert again.cached_tokens and again.cached_tokens >= BLOCK, "vLLM cached the prompt"
    assert again.agrees, f"a plain repeat: predicted {again.predicted}, vLLM {again.cached_tokens}"
    return again


def test_after_reset_prefix_cache_the_prediction_is_what_vllm_reports(real_front: Front) -> None:
    body = chat(7001)
    where = warm(real_front, "reset", body).replica
    for name, replica in real_front.replicas.items():
        r = httpx.post(replica.url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 200, r.text
        real_front.poke(name)
    real_front.settle_events(where)
    after = real_front.send("reset-after", "chat", body)
    assert after.cached_tokens == 0, "vLLM recomputes everything after a reset"
    assert after.predicted == after.cached_tokens, (
        f"after a reset: predicted {after.predicted}, vLLM 0 on {after.replica}; events: {real_front.kv_row(where)}"
    )


def test_after_evictions_in_a_small_cache_the_prediction_is_what_vllm_reports(real_front: Front) -> None:
    body = chat(7101)
    where = warm(real_front, "evict", body).replica
    replica = real_front.replicas[where]
    # distinct prompts straight to that replica, more tokens than its whole cache holds
    flood_tokens, i = 0, 0
    with httpx.Client(base_url=replica.url, timeout=300) as direct:
        while flood_tokens < FLEET_BLOCKS * BLOCK * 1.15:
            prompt = workload.text(5500, 7200 + i)
            r = direct.post("/v1/completions", json={"model": workload.MODEL, "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            flood_tokens += r.json()["usage"]["prompt_tokens"]
            i += 1
    real_front.settle_events(where)
    after = real_front.send("evict-after", "chat", body)
    assert after.cached_tokens is not None and after.cached_tokens < BLOCK * 4, "the flood evicted the prompt"
    assert after.predicted == after.cached_tokens, (
        f"after evictions: predicted {after.predicted}, vLLM {after.cached_tokens} on {after.replica}; "
        f"events: {real_front.kv_row(where)}"
    )


def test_a_burst_behind_a_busy_engine_hits_the_blocks_its_first_request_computes(real_front: Front) -> None:
    """The simulator's model of it (gateway/sim/engine.py ``_cache_scheduled``): vLLM v1 caches a
    block when it allocates the step's slots, so requests admitted in the same step as the
    first of a burst of one prompt (measured: all of them finish with it, in one step) already
    find that prompt's full blocks cached — a gateway predicting the burst's followers a hit
    on their leader's prefix is right even before the leader ran."""
    replica = next(iter(real_front.replicas.values()))
    blocker = {"model": workload.MODEL, "prompt": workload.text(4500, 7301), "max_tokens": 16}
    burst = {"model": workload.MODEL, "prompt": workload.text(450, 7302), "max_tokens": 1}

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=replica.url, timeout=300) as client:

            async def send(body: dict, delay: float) -> dict:
                await asyncio.sleep(delay)  # the burst arrives while the blocker's prefill runs
                response = await client.post("/v1/completions", json=body)
                response.raise_for_status()
                return response.json()["usage"]

            return await asyncio.gather(send(blocker, 0.0), *(send(burst, 0.05) for _ in range(4)))

    _, *usages = asyncio.run(run())
    full = usages[0]["prompt_tokens"] // BLOCK * BLOCK
    cached = sorted((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages)
    assert full >= BLOCK and cached == [0, full, full, full], (full, usages)


def _document_parting_mid_block(seed: int) -> str:
    """A document past the gateway's 4,096-token window whose end (where two questions on it
    part) lies late in one of the gateway's 1 KB text chunks — so the chunk before it ends
    more than a 128-token block earlier — and in the middle of one of vLLM's blocks: the
    gateway's resolution there (a 128-byte print, ~32 tokens) then decides the block."""
    from gateway.tokens.window import ModelWindows

    windows = ModelWindows("auto", 1 << 16, 0).for_model(workload.MODEL)
    for words in range(5000, 5600):
        document = workload.text(words, seed)
        into_chunk = (2 + len(document.encode())) % 1024  # a 2-byte mark starts the prompt's text
        if 850 <= into_chunk <= 1000 and 56 <= len(windows.text(document)) % BLOCK <= 100:
            return document
    raise AssertionError("no document length parts late in a chunk and mid-block")


def test_two_questions_on_one_document_past_the_window_are_predicted_as_vllm_reports(real_front: Front) -> None:
    """Past the window the gateway keys text in 1 KB chunks; a second question on a held
    document parts from the first inside a chunk.  With the engine's events (the whole window
    held) and the chunk prints, the prediction is what vLLM reports, not the chunk before."""
    document = _document_parting_mid_block(7401)
    body = {"model": workload.MODEL, "max_tokens": 4, "temperature": 0}
    first = {**body, "prompt": document + " Which of these came first, and why?"}
    front = real_front
    front.send("fork-first", "completions", first)
    again = front.send("fork-again", "completions", first)  # recorded with its prints, its replica precise
    assert again.cached_tokens and again.agrees, (again.predicted, again.cached_tokens)
    front.settle_events(again.replica)
    second = front.send("fork-second", "completions", {**body, "prompt": document + " Who wrote it?"})
    assert second.replica == again.replica and second.cached_tokens is not None
    assert second.cached_tokens > 4096 + BLOCK, "vLLM holds the document past the gateway's window"
    assert second.predicted == second.cached_tokens, (
        f"predicted {second.predicted}, vLLM {second.cached_tokens} of {second.prompt_tokens}; "
        f"text tail: {front.stats()['kv_events']['text_tail']}"
    )
