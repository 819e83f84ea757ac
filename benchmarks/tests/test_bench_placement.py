"""The placement benchmark measures what its table says: every request it scores takes the
relocation path (the header's timestamp and trace id are moved, nothing else), each placement
puts the values block where its row is named for and the prompts then share exactly up to it,
the score counts whole 16-token blocks of the earlier prompt, a workload without values scores
1.0, and a run writes the table and JSON the design note quotes.

The whole benchmark runs in well under a second (quicktok, 10 steps), so it is run as it ships.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_placement as bp
from gateway.prefix.normalize import Normalizer, NormalizeResult
from gateway.prefix.settings import NormalizeSettings
from gateway.tokens.chat_template import chat_tokens
from gateway.tokens.tokenizer import get_tokenizer

PLACEMENTS = ("end", "trailing_system", "last_user", "system_before_last_user")
BLOCK_TAG = "<volatile_values"


def _values(header_line: str) -> set[str]:
    """The timestamp and the trace id of ``header(k)``'s line."""
    stamp = header_line.split("Current time: ")[1].split(". Trace ")[0]
    trace = header_line.rsplit(" ", 1)[1].rstrip(".")
    return {stamp, trace}


def test_the_score_counts_whole_blocks_of_the_earlier_prompt() -> None:
    prev = list(range(40))  # 2 whole blocks and 8 tokens
    assert bp.shared_share(prev, [*prev, 99]) == 1.0
    assert bp.shared_share(prev, prev[:20] + [-1] * 20) == 0.5  # 20 shared: one whole block of two
    assert bp.shared_share(prev, [*prev[:15], -1]) == 0.0  # less than a block is nothing to reuse
    assert bp.shared_share(prev, prev[:33]) == 1.0  # both whole blocks, the partial one does not count
    assert bp.shared_share([1] * 10, [1] * 10) == 0.0  # no whole block: nothing to share, no division by 0


def test_the_score_is_the_mean_over_the_pairs_of_steps_up_to_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    pairs: list[tuple[list[int], list[int], float]] = []
    share = bp.shared_share

    def recording(prev: list[int], cur: list[int]) -> float:
        pairs.append((prev, cur, share(prev, cur)))
        return pairs[-1][2]

    monkeypatch.setattr(bp, "shared_share", recording)
    score = bp.chat_reuse("end", bp.tool_loop)
    assert len(pairs) == bp.STEPS - 2  # steps 3..10 against the step before: 2 is the first compared
    assert all(a[1] == b[0] for a, b in pairwise(pairs))  # consecutive steps
    assert all(len(prev) < len(cur) for prev, cur, _ in pairs)  # each step one tool call longer
    assert score == pytest.approx(sum(s for _, _, s in pairs) / len(pairs))


def test_the_workloads_are_what_the_docstring_describes() -> None:
    tokens = len(get_tokenizer().encode(bp.SYSTEM))
    assert 1500 < tokens < 2500, tokens  # "a ~2,000-token system prompt"
    assert bp.header(3) != bp.header(4) and _values(bp.header(3)) != _values(bp.header(4))  # fresh each step
    for k in range(1, bp.STEPS):
        loop, following = bp.tool_loop(k), bp.tool_loop(k + 1)
        assert loop[0]["content"].startswith(bp.header(k))
        assert following[1 : len(loop)] == loop[1:]  # the agent loop only grows
        calls = [m["tool_calls"][0]["id"] for m in loop if m["role"] == "assistant"]
        answers = [m["tool_call_id"] for m in loop if m["role"] == "tool"]
        assert calls == answers == [f"c{i}" for i in range(k)]
        chat, following = bp.conversation(k), bp.conversation(k + 1)
        assert following[1 : len(chat)] == chat[1:]  # the client resends its original history
        assert [m["role"] for m in chat][-1] == "user" and sum(m["role"] == "user" for m in chat) == k


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict[str, Any], NormalizeResult]]:
    seen: list[tuple[dict[str, Any], NormalizeResult]] = []

    class Recording(Normalizer):
        def apply(self, endpoint: str, body: dict[str, Any], *, learn: bool = True) -> NormalizeResult:
            result = super().apply(endpoint, body, learn=learn)
            seen.append((body, result))
            return result

    monkeypatch.setattr(bp, "Normalizer", Recording)
    return seen


def test_every_scored_request_takes_the_relocation_path(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _recording(monkeypatch)
    for placement in PLACEMENTS:
        bp.chat_reuse(placement, bp.tool_loop)
        bp.chat_reuse(placement, bp.conversation)
    bp.completion_reuse("end")
    bp.completion_reuse("after_span_line")
    assert len(seen) == (2 * len(PLACEMENTS) + 2) * bp.STEPS
    stable = set()
    for body, result in seen:
        text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        assert result.relocated, "a request was scored on the no-match path"
        assert {c.value for c in result.changes} == _values(text.split("\n", 1)[0])  # the header's, only
        new = result.body["messages"][0]["content"] if "messages" in body else result.body["prompt"]
        stable.add(new.split("\n", 1)[0])
    assert len(stable) == 1  # the header line is the same placeholders at every step, in every row


def _normalized(placement: str, k: int) -> list[dict[str, Any]]:
    norm = Normalizer(NormalizeSettings(mode="relocate", always=["*"], placement=placement))  # type: ignore[arg-type]
    return norm.apply("chat", {"model": "m", "messages": bp.tool_loop(k)}).body["messages"]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_each_placement_puts_the_block_where_its_row_says_and_reuse_stops_there(placement: str) -> None:
    messages = _normalized(placement, 3)
    holder = next(i for i, m in enumerate(messages) if BLOCK_TAG in (m["content"] or ""))
    expected = {"end": 7, "trailing_system": 8, "last_user": 1, "system_before_last_user": 1}[placement]
    assert holder == expected, [m["role"] for m in messages]
    if placement in ("trailing_system", "system_before_last_user"):
        assert messages[holder]["role"] == "system" and messages[holder]["content"].startswith(BLOCK_TAG)
    else:
        assert messages[holder]["content"].rstrip().endswith("</volatile_values>")  # appended to the message
    tok = get_tokenizer()
    prev, cur = (chat_tokens(tok, _normalized(placement, k), add_generation_prompt=True) for k in (3, 4))
    common = next(i for i, (a, b) in enumerate(zip(prev, cur, strict=False)) if a != b)
    text, shared = tok.decode(prev), tok.decode(prev[:common])
    block_at = text.index(BLOCK_TAG)
    # the prompts share everything up to the block (a role header at most before it, the
    # placeholder lines at most in it) and nothing after its first value
    assert block_at - 24 <= len(shared) < text.index("2025-03-04T", block_at)
    assert ("Rows:" in text[:block_at]) == (placement in ("end", "trailing_system"))  # after the tool results


@pytest.mark.parametrize("placement", ["end", "after_span_line"])
def test_each_completion_placement_puts_the_block_where_its_name_says(placement: str) -> None:
    settings = NormalizeSettings(mode="relocate", always=["*"], completion_placement=placement)  # type: ignore[arg-type]
    prompt = (
        Normalizer(settings).apply("completions", {"model": "m", "prompt": bp.header(3) + bp.SYSTEM}).body["prompt"]
    )
    first_line, rest = prompt.split("\n", 1)
    assert "{{volatile:" in first_line
    if placement == "end":
        assert rest.rstrip().endswith("</volatile_values>") and rest.startswith(bp.SYSTEM[:40])
    else:
        assert rest.startswith(BLOCK_TAG)  # right after the dated line: before the long prompt


def test_without_values_every_row_scores_full_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    # nothing to move, so step k is a prefix of step k+1 and a prefix cache reuses all of it
    monkeypatch.setattr(bp, "header", lambda k: "Current time: unknown.\n")
    for placement in PLACEMENTS:
        assert bp.chat_reuse(placement, bp.tool_loop) == 1.0, placement
        assert bp.chat_reuse(placement, bp.conversation) == 1.0, placement


def test_a_run_writes_its_table_and_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    (tmp_path / "results").mkdir()
    monkeypatch.setattr(bp, "__file__", str(tmp_path / "bench_placement.py"))  # main writes beside __file__
    bp.main()
    result = json.loads((tmp_path / "results" / "bench_placement.json").read_text())
    assert [row["placement"] for row in result["chat"]] == list(PLACEMENTS)
    assert result["steps"] == bp.STEPS and set(result["completions"]) == {"end", "after_span_line"}
    rows = {row["placement"]: row for row in result["chat"]}
    for row in rows.values():
        assert 0 <= row["tool_loop"] <= 1 and 0 <= row["conversation"] <= 1
    # what the table is for: the block at the end keeps the agent loop cached, before the tool
    # results it does not; a conversation ends with its user message, where end and last_user agree
    assert min(rows["end"]["tool_loop"], rows["trailing_system"]["tool_loop"]) > 0.9
    assert max(rows["last_user"]["tool_loop"], rows["system_before_last_user"]["tool_loop"]) < 0.8
    assert rows["end"]["conversation"] == rows["last_user"]["conversation"]
    assert result["completions"]["end"] > 0.9 > 0.1 > result["completions"]["after_span_line"]
    table = capsys.readouterr().out
    assert all(placement in table for placement in PLACEMENTS) and "completions: end=" in table
