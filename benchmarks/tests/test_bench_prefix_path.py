"""The hot-path benchmark times what it says: ~32k-token prompts keyed over the whole window,
the conversation's repeated history served from the token cache, cold text never, and every
decision recorded by the real policy."""

from __future__ import annotations

import pytest

from benchmarks import bench_prefix_path as bpp


@pytest.mark.parametrize("name", ["conversation", "cold"])
def test_a_scenario_keys_the_whole_window_of_a_long_prompt_and_routes_it(name: str) -> None:
    result = bpp.run_scenario(name, 4, 4096, seed=0)
    assert result["requests"] == 4  # the warm-up is not counted
    assert result["prompt_tokens"] > 25_000  # the issue's ~32k-token prompts
    assert result["keys_per_request"] >= 4096 // 16  # the window in token blocks, then text keys
    assert result["policy_index_keys"] > 0  # the policy recorded its choices
    assert result["cpu"]["route"]["p50_ms"] > 0 and result["cpu"]["tokenize_hash"]["p50_ms"] > 0
    hits = result["token_cache"]["hits"]
    # the conversation's history repeats (what the token cache is for); cold text never does
    assert hits > 0 if name == "conversation" else hits == 0
