"""The engine's timing *shape*: queueing past max_num_seqs, KV-limited admission, cache hits
shortening prefill.  Small time scales; assertions are orderings and relations, never times."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai
import pytest
from sim_helpers import client, poll, scrape

from gateway.sim import DEFAULT_MODEL


class Load:
    """Fire requests from threads; record (index, latency, response or exception)."""

    def __init__(self, c: openai.OpenAI) -> None:
        self.c = c
        self.results: list[tuple[int, float, Any]] = []
        self.threads: list[threading.Thread] = []

    def completion(self, index: int, **kwargs: Any) -> None:
        def run() -> None:
            start = time.perf_counter()
            try:
                out: Any = self.c.completions.create(model=DEFAULT_MODEL, **kwargs)
            except Exception as exc:
                out = exc
            self.results.append((index, time.perf_counter() - start, out))

        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)

    def join(self) -> list[tuple[int, float, Any]]:
        for t in self.threads:
            t.join(timeout=60)
        return sorted(self.results)


def _state(url: str) -> dict[str, Any]:
    return httpx.get(url + "/sim/state").json()


@pytest.mark.slow
def test_requests_queue_when_more_arrive_than_max_num_seqs(make_sim) -> None:
    url = make_sim(time_scale=0.5, decode_ms_per_token=20, max_num_seqs=2, enable_admin=True)
    load = Load(client(url))
    for i in range(6):
        load.completion(i, prompt=f"request {i}", max_tokens=30)
    seen = poll(lambda: (s := _state(url))["waiting"] >= 1 and s)
    assert seen["running"] == 2  # never more than max_num_seqs in the batch
    m = scrape(url)
    assert m["vllm:num_requests_waiting"] >= 1 and m["vllm:num_requests_running"] == 2
    results = load.join()
    assert all(isinstance(r[2], openai.types.Completion) for r in results)
    after = scrape(url)
    assert after["vllm:request_queue_time_seconds_count"] == 6
    assert after["vllm:request_queue_time_seconds_sum"] > 0
    assert after["vllm:num_requests_waiting"] == 0 and after["vllm:num_requests_running"] == 0
    # the queued requests took longer end to end than the quickest ones
    latencies = sorted(r[1] for r in results)
    assert latencies[-1] > latencies[0] * 1.5


@pytest.mark.slow
def test_full_kv_cache_makes_requests_wait_and_preempts(make_sim) -> None:
    # 24 blocks of 16 tokens; each request needs 10 blocks for its prompt and 13 at its end
    url = make_sim(time_scale=0.5, decode_ms_per_token=20, num_gpu_blocks=24, max_num_seqs=8, enable_admin=True)
    load = Load(client(url))
    for i in range(3):
        load.completion(i, prompt=[1000 * (i + 1) + t for t in range(160)], max_tokens=40)
    seen = poll(lambda: (s := _state(url))["waiting"] >= 1 and s["running"] >= 1 and s)
    assert seen["running"] < 3  # room in max_num_seqs, none in the KV cache
    results = load.join()
    assert [r[2].usage.completion_tokens for r in results] == [40, 40, 40]
    m = scrape(url)
    assert m["vllm:num_preemptions_total"] >= 1  # decodes outgrew the pool: recompute preemption
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:prefix_cache_queries_total"] == 3 * 160  # a readmission is not a second query


def test_cache_hits_shorten_time_to_first_token(make_sim, monkeypatch: pytest.MonkeyPatch) -> None:
    # A miss costs 0.6 s of simulated prefill, a hit 8 tokens' worth.  The engine's step lengths
    # are recorded as it computes them (not measured): a busy machine cannot flake the check.
    from gateway.sim.engine import Engine

    steps: list[float] = []
    schedule = Engine._schedule

    def recording(self: Engine) -> tuple[list, int]:
        scheduled, prefill_tokens = schedule(self)
        if scheduled:
            steps.append((self.step_base_s + prefill_tokens / self.prefill_tps) * self.time_scale)
        return scheduled, prefill_tokens

    monkeypatch.setattr(Engine, "_schedule", recording)
    url = make_sim(time_scale=1.0, prefill_tokens_per_s=5000, decode_ms_per_token=5)
    c = client(url)
    prompt = [7 + t % 1000 for t in range(3000)]

    def ttft() -> tuple[float, int]:
        start = time.perf_counter()
        stream = c.completions.create(
            model=DEFAULT_MODEL, prompt=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
        first = None
        cached = 0
        for chunk in stream:
            if chunk.choices and first is None:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        assert first is not None
        return first, cached

    miss, miss_cached = ttft()
    miss_steps = sum(steps)
    steps.clear()
    hit, hit_cached = ttft()
    hit_steps = sum(steps)
    assert miss_cached == 0 and hit_cached == 2992
    assert miss_steps >= 3000 / 5000  # the whole prompt was prefilled
    assert hit_steps < miss_steps / 10  # prefill of 8 uncached tokens vs 3000 (plus two decode steps)
    assert hit > 0 and miss >= 3000 / 5000  # a sleep is never shorter than asked: the miss really waited


def test_stream_is_incremental_and_disconnect_aborts(make_sim) -> None:
    url = make_sim(time_scale=1.0, decode_ms_per_token=10, enable_admin=True)
    with httpx.stream(
        "POST", url + "/v1/completions", json={"prompt": "go", "max_tokens": 500, "stream": True}, timeout=30
    ) as resp:
        events = resp.iter_lines()
        first = next(e for e in events if e.startswith("data: "))
        assert '"text"' in first
        # the first token reached us while the request is still decoding: nothing is buffered
        assert _state(url)["running"] == 1
    poll(lambda: _state(url)["running"] == 0)
    m = scrape(url)
    assert m["vllm:request_success_total{finished_reason=abort}"] == 1
    assert m["vllm:generation_tokens_total"] < 500


def test_an_engine_bug_fails_requests_instead_of_hanging(make_sim, monkeypatch) -> None:
    from gateway.sim.engine import Engine

    def broken(self: Engine) -> None:
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(Engine, "_schedule", broken)
    url = make_sim(time_scale=1.0)
    c = client(url, timeout=20)
    with pytest.raises(openai.APIStatusError) as info:
        c.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=3)
    assert info.value.status_code == 503
    assert httpx.get(url + "/health").status_code == 200
