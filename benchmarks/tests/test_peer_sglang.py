"""The SGLang router row: started in front of simulated replicas, measured like our gateway."""

from __future__ import annotations

import asyncio
import random

import pytest

from benchmarks import peer_sglang
from benchmarks.bench_policies import prefill_work, probe_id_prefixes
from benchmarks.replay import id_prefix, prepare, replay, replica_of_id, summarize
from benchmarks.workloads import BenchRequest
from benchmarks.workloads.text import words

MODEL = "demo-model"


def test_response_ids_name_their_replica():
    prefix = id_prefix(["cmpl-2493e6e93756000001", "chatcmpl-2493e6e93756000002"])
    assert prefix == "2493e6e93756"
    table = {prefix: "r1", "aaaaaaaaaaaa": "r0"}
    assert replica_of_id("chatcmpl-2493e6e93756000099", table) == "r1"
    assert replica_of_id("cmpl-ffffffffffff01", table) is None
    assert id_prefix(["cmpl-abc1", "cmpl-abd2"]) is None  # too little in common: no attribution


def test_prefill_work_is_uncached_tokens_per_replica_idle_ones_included():
    before = [{"prefix_cache_queries": 0, "prefix_cache_hits": 0}] * 3
    after = [
        {"prefix_cache_queries": 1000, "prefix_cache_hits": 400},
        {"prefix_cache_queries": 300, "prefix_cache_hits": 0},
        {"prefix_cache_queries": 0, "prefix_cache_hits": 0},
    ]
    work = prefill_work(before, after, ["a", "b", "c"])
    assert work["per_replica"] == {"a": 600, "b": 300, "c": 0}
    assert work["max_over_mean"] == pytest.approx(600 / 300)


@pytest.mark.skipif(peer_sglang.unavailable_reason() is not None, reason="sglang-router not installed")
@pytest.mark.slow
def test_sglang_router_row_serves_the_same_requests_and_reports_cached_tokens(tmp_path):
    from gateway.sim.launcher import run_replicas

    system = words(random.Random(1), 400)
    reqs = [
        BenchRequest(
            t=i * 0.05,
            endpoint="chat" if i % 2 else "completions",
            body={"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]}
            if i % 2
            else {"prompt": system + f" q{i}"},
            max_tokens=2,
            prompt_tokens=400,
        )
        for i in range(6)
    ]
    with run_replicas(2, model=MODEL, time_scale=0, enable_admin=True, log_dir=tmp_path) as urls:
        names = ["r0", "r1"]
        prefixes = probe_id_prefixes(urls, names)
        assert sorted(prefixes.values()) == names
        router = peer_sglang.start(urls, tmp_path)
        try:
            peer_sglang.wait_ready(router, MODEL, deadline_s=60)
            result = asyncio.run(
                replay(
                    prepare(reqs, MODEL, 1.0), [router.url], deadline_s=30, replica_names=names, id_prefixes=prefixes
                )
            )
        finally:
            router.stop()
    assert all(o.ok for o in result.outcomes), [o.error for o in result.outcomes]
    assert all(o.replica in names for o in result.outcomes)  # attributed by response id
    summary = summarize(result)
    assert summary.cached_unknown == 0 and summary.hit_rate and summary.hit_rate > 0.3  # shared system prompt
