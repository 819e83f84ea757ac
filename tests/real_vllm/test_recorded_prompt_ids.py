"""The gateway's tokens for each recorded request equal the real engine's, id for id.

No engine needed (this runs in the main suite): tests/fixtures/real_vllm/requests.jsonl holds
what vLLM 0.32 itself computed for each request (``POST /tokenize`` with the same messages and
tools, or the same prompt). The gateway's side is what a default route computes for the request's
model (``tokenizer: auto`` → Llama 3.1: the bundled llama3 vocabulary and the Python rendering of
Meta's template). Block keys follow these ids, so any difference here is a misprediction there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.config.schema import NormalizeSettings
from gateway.prefix.pipeline import PrefixPipeline
from gateway.prefix.settings import PrefixSettings
from gateway.tokens.window import ModelWindows

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real_vllm"
WHOLE = 1 << 16  # a window longer than any recorded prompt (max_model_len 8192): whole-prompt ids


def recorded(name: str = "requests.jsonl") -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("prompt_token_ids")]


ROWS = recorded()
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


def base_models() -> dict[str, str]:
    """Served id -> the model it tokenizes as: a LoRA adapter's ``parent`` in /v1/models (the contract's base)."""
    data = json.loads((FIXTURES / "models.json").read_text())["data"]
    return {m["id"]: m.get("parent") or m["id"] for m in data}


BASE = base_models()


def gateway_ids(windows: ModelWindows, row: dict[str, Any]) -> list[int]:
    body = row["request"]
    tokens = windows.for_model(BASE.get(body["model"], body["model"]))
    if ENDPOINTS[row["endpoint"]] == "chat":
        return list(tokens.chat(body["messages"], body.get("tools")))
    return list(tokens.text(body["prompt"]))


def usage_of(row: dict[str, Any]) -> dict[str, Any]:
    if row.get("sse"):
        usage: dict[str, Any] = {}
        for line in row["sse"]:
            if line != "[DONE]":
                usage = json.loads(line).get("usage") or usage
        return usage
    return row["response"]["usage"]


def test_the_recording_covers_the_lane_workload() -> None:
    ids = {r["id"] for r in ROWS}
    kinds = {(ENDPOINTS[r["endpoint"]], bool(r["request"].get("stream"))) for r in ROWS}
    assert kinds == {("chat", False), ("chat", True), ("completions", False), ("completions", True)}
    assert any(i.startswith("special-") for i in ids), "a conversation with special-token text"
    assert any(r["request"].get("tools") for r in ROWS), "requests with tools"
    assert any(m.get("tool_calls") for r in ROWS for m in r["request"].get("messages", []) if isinstance(m, dict)), (
        "a tool call in the history"
    )
    assert any(BASE.get(r["request"]["model"]) != r["request"]["model"] for r in ROWS), "a LoRA adapter as model"
    assert any(r["request"].get("cache_salt") for r in ROWS), "cache_salt"
    assert len(ROWS) >= 25


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_tokenize_ids_are_what_the_engine_served(row: dict[str, Any]) -> None:
    """The fixture's own check: /tokenize counted exactly the prompt tokens the request reported."""
    assert usage_of(row)["prompt_tokens"] == len(row["prompt_token_ids"])


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_gateway_tokens_equal_the_engines(row: dict[str, Any]) -> None:
    windows = ModelWindows("auto", WHOLE, 0)
    ours, theirs = gateway_ids(windows, row), row["prompt_token_ids"]
    if ours != theirs:
        at = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
        )
        pytest.fail(
            f"{row['id']}: {len(ours)} gateway tokens vs {len(theirs)} engine tokens, first difference at {at}: "
            f"gateway {ours[at : at + 8]} engine {theirs[at : at + 8]}"
        )


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_default_route_window_is_the_engines_leading_tokens(row: dict[str, Any]) -> None:
    """What a default route really hashes (its bounded window) is the head of the engine's ids."""
    pipeline = PrefixPipeline(NormalizeSettings(), PrefixSettings())
    body = dict(row["request"], model=BASE.get(row["request"]["model"], row["request"]["model"]))
    window = list(pipeline.window_tokens(ENDPOINTS[row["endpoint"]], body))
    theirs = row["prompt_token_ids"]
    assert len(window) == min(len(theirs), PrefixSettings().window_tokens)
    assert window == theirs[: len(window)]
