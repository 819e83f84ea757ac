"""The event-ingestion benchmark measures what it says: its frames decode and apply without a
skip, its cache stays the size it models, past the window blocks are kept by depth, and the
decision-cost fleet routes each prompt to its holder from the engines' word."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import bench_kv_events as bk


@pytest.mark.parametrize("name", ["gpu_prefill", "cpu_prefill", "decode_steps", "past_window", "cpu_keyed_16"])
def test_every_scenario_applies_every_event_it_times(name: str) -> None:
    block_size, low, high = bk.SCENARIOS[name]
    messages, events, _blocks = bk._messages(block_size, low, high, 300, seed=0)
    ingestor, decode_s, apply_s = bk.ingest(name, messages)
    feed = ingestor.feeds["r0"]
    assert (feed.messages, feed.events) == (len(messages), events)  # every message heard, none dropped
    assert not any(feed.dropped.values()) and feed.gaps == 0
    index = ingestor.index
    assert not any(count for reason, count in index.skipped.items() if reason != "deep")
    assert 0 < index.blocks("r0") <= 4096  # the scenario's cache: evicted as stored past 4,096 blocks
    # past_window keys 64 blocks of each prompt and keeps the rest by depth; the others key them all
    assert (index.skipped["deep"] > 0) == (name == "past_window")
    # cpu_keyed_16 keys each 128-token engine block as eight of the route's 16-token keys
    assert index.keyed_size("r0") == bk.KEYED_AT.get(name, block_size)
    assert index.memory_bytes() // index.entry_bytes() >= index.blocks("r0") * (block_size // index.keyed_size("r0"))
    assert decode_s > 0 and apply_s > 0


def test_the_decision_fleet_routes_each_prompt_to_its_holder_from_the_engines_word() -> None:
    for project in (None, True):
        policy, views, requests, holders = bk.decision_fleet(4, True, prompts=8, project=project)
        for request, holder in zip(requests, holders, strict=True):
            decision = policy.peek(request, views)
            assert decision.replica == holder
            assert decision.detail["kv_mode"] == "precise"
            assert decision.detail["predicted_cached_tokens"] == 4096  # the whole window
    policy, views, requests, _ = bk.decision_fleet(4, False, prompts=8)
    assert "kv_mode" not in policy.peek(requests[0], views).detail  # the model's row: no matcher


def test_a_quick_run_writes_its_table_and_json(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "kv.json"
    monkeypatch.setattr(sys, "argv", ["bench_kv_events.py", "--quick", "--replicas", "4", "--out", str(out)])
    monkeypatch.setattr(bk, "SCENARIOS", {"gpu_prefill": bk.SCENARIOS["gpu_prefill"]})
    bk.main()
    result = json.loads(out.read_text())
    assert result["scenarios"]["gpu_prefill"]["events_per_s"] > 0
    assert set(result["decision_cost"]["4"]) >= {"model_us", "precise_us", "projected_us"}
    assert "gpu_prefill" in capsys.readouterr().out
