"""End to end: the prefill work the gateway sees queued on a replica, through real requests.

A slow simulated replica (1,000 prompt tokens per second, 0.3 s per output token) makes the
phases observable: while the prompt is being prefilled, the replica's queued prefill equals
the prompt's uncached tokens; once the first chunk reaches the client it is 0 while the
request is still in flight (decoding); and it is 0 again, with nothing in flight, at the end.
Every other way an attempt ends (retry on another replica after a 503, a non-streaming
answer, a client that leaves before the first byte) must hand the charge back too.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import ADMIN_KEY, MODEL, admin, client, gateway, metric_sum, prompt_tokens_of, wait_for

from gateway.sim.launcher import ReplicaGroup, run_replicas


def replica_state(gw: Any, name: str = "r0") -> dict[str, Any]:
    with admin(gw) as http:
        stats = http.get("/admin/stats").json()
    return stats["replicas"][name]


def all_idle(gw: Any) -> dict[str, Any] | None:
    """Every replica's state once nothing is in flight anywhere (None until then)."""
    with admin(gw) as http:
        replicas = http.get("/admin/stats").json()["replicas"]
    return replicas if all(r["in_flight"] == 0 for r in replicas.values()) else None


@pytest.mark.slow
def test_queued_prefill_is_counted_until_the_first_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    slow = {
        "time_scale": 1.0,
        "prefill_tokens_per_s": 1000.0,
        "decode_ms_per_token": 300.0,
        "disable_uvicorn_access_log": True,
        "disable_log_stats": True,
    }
    messages = [{"role": "user", "content": "Tell me about prefix caches. " * 150}]
    prompt = prompt_tokens_of(messages, add_generation_prompt=True)
    assert 900 < prompt < 4096  # about a second of prefill, and inside the keyed window: counted exactly
    with run_replicas(1, log_dir=tmp_path / "sims", **slow) as urls, gateway(urls) as gw:
        sdk = client(gw)
        first_chunk = threading.Event()
        finish = threading.Event()
        chunks: list[Any] = []

        def consume() -> None:
            stream = sdk.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, stream=True, extra_body={"ignore_eos": True}
            )
            for chunk in stream:
                chunks.append(chunk)
                first_chunk.set()
                finish.wait(timeout=30)  # hold the stream open until the test has looked

        worker = threading.Thread(target=consume, daemon=True)
        worker.start()
        queued = wait_for(lambda: (s := replica_state(gw))["pending_prefill_tokens"] and s, what="queued prefill")
        assert queued["in_flight"] == 1 and queued["pending_prefill_tokens"] == prompt
        with admin(gw) as http:
            text = http.get("/metrics").text
        assert metric_sum(text, "prefix_gateway_replica_pending_prefill_tokens", replica="r0") == prompt
        assert first_chunk.wait(timeout=15)
        state = replica_state(gw)
        assert state["in_flight"] == 1 and state["pending_prefill_tokens"] == 0  # decoding, nothing queued
        finish.set()
        worker.join(timeout=30)
        assert not worker.is_alive() and chunks
        done = wait_for(lambda: (s := replica_state(gw))["in_flight"] == 0 and s, what="request finished")
        assert done["pending_prefill_tokens"] == 0


@pytest.mark.slow
def test_every_way_an_attempt_ends_hands_the_charge_back(
    fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    urls = fleet.urls
    httpx.post(f"{urls[0]}/sim/faults", json={"error_rate": 1.0, "error_status": 503}).raise_for_status()
    with gateway(urls) as gw:
        sdk = client(gw)
        for i in range(12):  # different conversations: some are placed on r0 and retried elsewhere
            messages = [{"role": "user", "content": f"Conversation {i}: " + "tell me more. " * 40}]
            sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
            stream = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True)
            assert [c for c in stream]
        with admin(gw) as http:
            text = http.get("/metrics").text
        assert metric_sum(text, "prefix_gateway_retries_total") >= 1  # the retry path ran
        idle = wait_for(lambda: all_idle(gw), what="nothing in flight")
        assert {name: r["pending_prefill_tokens"] for name, r in idle.items()} == dict.fromkeys(idle, 0)

    # a client that leaves while its prompt is still being prefilled
    slow = {"time_scale": 1.0, "prefill_tokens_per_s": 500.0, "disable_uvicorn_access_log": True}
    with run_replicas(1, log_dir=tmp_path / "slow", **slow) as slow_urls, gateway(slow_urls) as gw:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "A long question. " * 200}],
            "max_tokens": 4,
            "stream": True,
        }
        with httpx.Client(base_url=gw.url, timeout=30) as http, http.stream("POST", "/v1/chat/completions", json=body):
            wait_for(lambda: replica_state(gw)["pending_prefill_tokens"] > 0, what="queued prefill")
        # the stream was closed before its first byte: the gateway aborts it and hands the charge back
        idle = wait_for(lambda: all_idle(gw), what="the abandoned request to end")
        assert idle["r0"]["pending_prefill_tokens"] == 0
