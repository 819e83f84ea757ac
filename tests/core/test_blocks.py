"""Chained block keys: stable across processes, prefix-shaped, separated by model and salt."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway.prefix.blocks import chain_block_keys, first_block_seed


def test_only_full_blocks_get_keys_and_chain_is_prefix_shaped() -> None:
    seed = first_block_seed("m")
    tokens = list(range(50))
    keys = chain_block_keys(tokens, 16, seed)
    assert len(keys) == 3
    assert chain_block_keys(tokens[:32], 16, seed) == keys[:2]
    changed = [*tokens[:20], 999, *tokens[21:]]
    other = chain_block_keys(changed, 16, seed)
    assert other[0] == keys[0] and other[1] != keys[1] and other[2] != keys[2]
    assert chain_block_keys(tokens, 16, seed, max_blocks=1) == keys[:1]


def test_model_lora_and_salt_separate_keys() -> None:
    tokens = list(range(32))
    base = chain_block_keys(tokens, 16, first_block_seed("m"))
    assert chain_block_keys(tokens, 16, first_block_seed("m2"))[0] != base[0]
    assert chain_block_keys(tokens, 16, first_block_seed("m", cache_salt="tenant"))[0] != base[0]
    assert chain_block_keys(tokens, 16, first_block_seed("m", lora="adapter"))[0] != base[0]
    assert first_block_seed("m", "", "") == first_block_seed("m")


def test_keys_are_stable_across_processes() -> None:
    code = "from gateway.prefix.blocks import *; print(chain_block_keys(list(range(64)), 16, first_block_seed('m')))"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert outs == {str(chain_block_keys(list(range(64)), 16, first_block_seed("m"))) + "\n"}


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        chain_block_keys([1, 2], 0, 1)
