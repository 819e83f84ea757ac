"""The sizing benchmark (numbers for docs/sizing.md) measures what it says: the index it fills
holds the pairs it counts, within the byte budget the index checks itself against, and the
prefix path it times keys the window and publishes records of the choices it made."""

from __future__ import annotations

import pytest

from benchmarks import bench_sizing as bs


@pytest.mark.parametrize("modelled", [False, True])
def test_the_filled_index_holds_every_pair_within_its_own_budget(modelled: bool) -> None:
    result = bs.index_memory(4000, modelled)
    assert result["pairs"] == 4000  # nothing evicted: the bound is far away
    assert 0 < result["memory_bytes_per_pair"] <= result["budget_bytes_per_pair"]
    assert result["tracemalloc_bytes_per_pair"] <= result["memory_bytes_per_pair"]  # the count is not an undercount


@pytest.mark.parametrize("kind", ["cold", "conversation"])
def test_the_prefix_path_keys_the_window_and_publishes_each_choice(kind: str) -> None:
    result = bs.prefix_path(kind, 8000, 16)
    assert result["prompt_tokens"] > 7000
    assert result["keys_per_request"] >= 4096 // 16  # the window's blocks, then text keys
    assert result["stored_keys_per_record"] >= result["keys_per_request"] // 4  # the stride-4 keys
    # 16 records batched into one message cost about 16 records (one envelope, not 16)
    assert 15 * result["record_bytes"] < result["batch_of_16_bytes"] < 17 * result["record_bytes"]


def test_a_load_report_grows_with_the_fleet() -> None:
    assert bs.load_report_bytes(4) < bs.load_report_bytes(64) < bs.load_report_bytes(256)
