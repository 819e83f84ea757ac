"""Metrics and log lines with vLLM's names, labels and format."""

from __future__ import annotations

import logging
import re

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sim_helpers import client, poll, scrape

from gateway.sim import DEFAULT_MODEL
from gateway.sim.options import build_options

MESSAGES = [{"role": "system", "content": "shared system prompt " * 20}, {"role": "user", "content": "hi"}]

CURRENT_NAMES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:cache_config_info",
}


def test_metrics_parse_with_vllm_names_and_labels(sim: str, oai: openai.OpenAI) -> None:
    oai.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=3)
    resp = httpx.get(sim + "/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    assert set(families) >= CURRENT_NAMES
    for name, family in families.items():
        if not name.startswith("vllm:"):
            continue
        for sample in family.samples:
            assert sample.labels["engine"] == "0", sample
            if name != "vllm:cache_config_info":
                assert sample.labels["model_name"] == DEFAULT_MODEL, sample
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "8192"
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons


def test_counters_match_the_sum_of_usage(sim: str, oai: openai.OpenAI) -> None:
    usages = []
    for i in range(3):  # repeats of one prompt (hits) and a few distinct ones
        usages.append(oai.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=2 + i).usage)
        usages.append(oai.completions.create(model=DEFAULT_MODEL, prompt=f"prompt number {i} " * 30).usage)
    stream = oai.chat.completions.create(
        model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    usages.append([c for c in stream if c.usage][-1].usage)
    m = scrape(sim)
    assert all(u is not None and u.prompt_tokens_details is not None for u in usages)
    assert m["vllm:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert m["vllm:generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    assert m["vllm:prefix_cache_queries_total"] == sum(u.prompt_tokens for u in usages)
    assert m["vllm:prefix_cache_hits_total"] == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert m["vllm:prefix_cache_hits_total"] > 0
    finished = (
        m["vllm:request_success_total{finished_reason=stop}"] + m["vllm:request_success_total{finished_reason=length}"]
    )
    assert finished == len(usages)
    assert m["vllm:time_to_first_token_seconds_count"] == len(usages)
    assert m["vllm:e2e_request_latency_seconds_count"] == len(usages)
    assert m["vllm:inter_token_latency_seconds_count"] == sum(u.completion_tokens - 1 for u in usages)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


def _fields(line: str) -> dict[str, str]:
    """Parse the engine line key by key, as the gateway's tooling is told to."""
    head, _, rest = line.partition(": ")
    assert re.fullmatch(r"Engine \d{3}", head), line
    return dict(part.split(": ", 1) for part in rest.split(", "))


def test_engine_log_line_in_vllm_format(make_sim, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gateway.sim.stats")
    url = make_sim(log_stats_interval=0.05)
    c = client(url)
    c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=5)
    c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=5)

    m = scrape(url)
    expected_rate = f"{100 * m['vllm:prefix_cache_hits_total'] / m['vllm:prefix_cache_queries_total']:.1f}%"

    def info_lines() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "gateway.sim.stats" and r.levelno == logging.INFO and "Avg prompt" in r.getMessage()
        ]

    # the first INFO line after both requests covers the whole hit-rate window
    line = poll(lambda: next((x for x in info_lines() if _fields(x)["Prefix cache hit rate"] == expected_rate), None))
    assert line.startswith("Engine 000: Avg prompt throughput: ")
    fields = _fields(line)
    assert list(fields) == [
        "Avg prompt throughput",
        "Avg generation throughput",
        "Running",
        "Waiting",
        "GPU KV cache usage",
        "Prefix cache hit rate",
    ]
    assert all(re.fullmatch(r"\d+\.\d tokens/s", fields[k]) for k in list(fields)[:2])
    assert any(float(_fields(x)["Avg generation throughput"].split()[0]) > 0 for x in info_lines())
    assert fields["Running"] == "0 reqs" and fields["Waiting"] == "0 reqs"
    assert fields["GPU KV cache usage"] == "0.0%"
    assert expected_rate != "0.0%"
    # an idle engine's line goes to DEBUG, like vLLM's (no noise on a quiet replica)
    poll(lambda: any(r.levelno == logging.DEBUG and r.name == "gateway.sim.stats" for r in caplog.records))


def test_access_log_includes_health_checks(make_sim, caplog: pytest.LogCaptureFixture) -> None:
    """In a thread the host owns logging; the process mode (and its off switch) is tested with the launcher."""
    caplog.set_level(logging.INFO, logger="uvicorn.access")
    url = make_sim()
    httpx.get(url + "/health")
    poll(lambda: any('"GET /health HTTP/1.1" 200' in r.getMessage() for r in caplog.records))


@pytest.mark.parametrize(
    ("naming", "present", "absent"),
    [
        ("legacy", {"vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_hits_total"}, {"vllm:kv_cache_usage_perc"}),
        ("both", {"vllm:gpu_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"}, set()),
    ],
)
def test_legacy_metric_names_for_testing_fallbacks(make_sim, naming: str, present: set, absent: set) -> None:
    url = make_sim(metrics_naming=naming)
    c = client(url)
    for _ in range(2):
        c.completions.create(model=DEFAULT_MODEL, prompt=list(range(100, 200)), max_tokens=2)
    m = scrape(url)
    names = {k.split("{")[0] for k in m}
    assert present <= names and not absent & names
    assert m["vllm:gpu_prefix_cache_hits_total"] == 96
    if naming == "both":
        assert m["vllm:prefix_cache_hits_total"] == 96
        assert m["vllm:time_per_output_token_seconds_count"] == m["vllm:inter_token_latency_seconds_count"] == 2


def test_restart_can_reset_counters(sim: str, oai: openai.OpenAI) -> None:
    oai.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=2)
    assert scrape(sim)["vllm:generation_tokens_total"] == 2
    httpx.post(sim + "/sim/restart", json={})
    assert scrape(sim)["vllm:generation_tokens_total"] == 2  # a flush alone keeps counters
    httpx.post(sim + "/sim/restart", json={"reset_metrics": True})
    assert scrape(sim)["vllm:generation_tokens_total"] == 0
    assert httpx.get(sim + "/sim/state").json()["prefix_cache_queries"] == 0  # /sim/state's totals too
    oai.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=3)
    assert scrape(sim)["vllm:generation_tokens_total"] == 3


def test_cpu_engine_log_line_says_cpu_kv_cache_usage() -> None:
    """vLLM's CPU backend writes ``CPU KV cache usage``; ``device="cpu"`` makes the sim do so."""
    from gateway.sim.replica import Replica
    from gateway.sim.statslog import StatsLogger

    for device, name in (("cuda", "GPU KV cache usage"), ("cpu", "CPU KV cache usage")):
        replica = Replica(build_options(device=device))
        _, line = StatsLogger(replica.engine, 10.0).format_line()
        assert list(_fields(line))[4] == name, line
