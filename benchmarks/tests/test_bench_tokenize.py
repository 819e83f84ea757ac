"""The tokenization benchmark measures what its table says: the texts are of the sizes their
rows are named for and new each repetition, the two columns time quicktok and tiktoken (not one
of them twice) with ``encode_ordinary`` semantics, each text is timed once on the thread's CPU
clock, the ids really are compared (a run with one id off stops), and a run writes the table
and JSON docs/prefix-routing.md quotes.

Runs use ``-n 2`` (two texts per size): the rows' structure and values, never their timings.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import bench_tokenize as bt
from gateway.tokens.tokenizer import (
    QuicktokTokenizer,
    TiktokenTokenizer,
    get_reference_tokenizer,
    get_tokenizer,
)

REFERENCED = ("cl100k_base", "o200k_base")  # the vocabularies tiktoken has
BUNDLED = ("llama3", "qwen3")  # quicktok only


def test_the_texts_are_of_the_size_their_row_is_named_for_and_new_each_time() -> None:
    rng = random.Random(7)
    tok = get_tokenizer("cl100k_base")
    for size in (7_000, 32_000):
        text = bt.make_text(rng, size)
        assert abs(len(tok.encode(text)) - size) < 0.1 * size, size  # "about 7,000 and 32,000 cl100k tokens"
    texts = [bt.make_text(rng, 2_000) for _ in range(3)]
    assert len({text[:200] for text in texts}) == 3  # no repetition repeats another: no cache helps
    # prose with code and a little non-English text, not only the word list
    assert any(piece in texts[0] for piece in bt.EXTRA if piece.isascii())
    assert any(piece in texts[0] for piece in bt.EXTRA if not piece.isascii())


def test_the_columns_time_quicktok_against_tiktoken() -> None:
    for name in REFERENCED:
        fast, ref = get_tokenizer(name), get_reference_tokenizer(name)
        assert isinstance(fast, QuicktokTokenizer), f"{name}: the quicktok column would time {type(fast)}"
        assert isinstance(ref, TiktokenTokenizer)
        # encode_ordinary semantics: a special token's text is ordinary text, in both
        ids = fast.encode("a <|endoftext|> b")
        assert ids == ref.encode("a <|endoftext|> b") and fast.special_id("<|endoftext|>") not in ids
    for name in BUNDLED:
        assert isinstance(get_tokenizer(name), QuicktokTokenizer), name


def test_each_text_is_timed_once_on_the_threads_cpu_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter(range(100))
    # only thread_time: a wall clock (or process time, which counts other threads) would raise here
    monkeypatch.setattr(bt, "time", SimpleNamespace(thread_time=lambda: next(ticks) / 1000))
    encoded: list[str] = []
    times = bt.time_encode(encoded.append, ["a", "b", "c"])
    assert encoded == ["a", "b", "c"]
    assert times == pytest.approx([1.0, 1.0, 1.0])  # milliseconds between each text's two readings


def _run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *argv: str) -> Path:
    out = tmp_path / "results" / "bench_tokenize.json"
    monkeypatch.setattr(bt, "ROOT", tmp_path)  # main prints RESULTS relative to ROOT
    monkeypatch.setattr(bt, "RESULTS", out)
    monkeypatch.setattr(sys, "argv", ["bench_tokenize.py", *argv])
    bt.main()
    return out


def test_a_run_stops_when_the_ids_differ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = bt.get_tokenizer

    def one_id_off(name: str) -> object:
        tok = real(name)
        if name != "o200k_base":
            return tok
        return SimpleNamespace(encode=lambda text: tok.encode(text)[:-1])

    monkeypatch.setattr(bt, "get_tokenizer", one_id_off)
    with pytest.raises(AssertionError, match="o200k_base: ids differ"):
        _run(monkeypatch, tmp_path, "-n", "1")
    assert not (tmp_path / "results" / "bench_tokenize.json").exists()


def test_a_quick_run_writes_its_table_and_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    timed: list[type] = []
    time_encode = bt.time_encode

    def recording(encode, texts: list[str]) -> list[float]:
        timed.append(type(encode.__self__))
        return time_encode(encode, texts)

    monkeypatch.setattr(bt, "time_encode", recording)
    result = json.loads(_run(monkeypatch, tmp_path, "-n", "2").read_text())
    # per size: quicktok then tiktoken for each OpenAI vocabulary, quicktok for the open ones
    per_size = [QuicktokTokenizer, TiktokenTokenizer] * len(REFERENCED) + [QuicktokTokenizer] * len(BUNDLED)
    assert timed == per_size * 2
    assert result["texts_per_size"] == 2 and result["python"] and result["machine"]
    rows = result["rows"]
    assert [(r["encoding"], r["target_tokens"]) for r in rows] == [
        (name, size) for size in (7_000, 32_000) for name in (*REFERENCED, *BUNDLED)
    ]
    for r in rows:
        assert abs(r["mean_tokens"] - r["target_tokens"]) < 0.1 * r["target_tokens"], r
        assert r["quicktok_ms_median"] > 0
        if r["encoding"] in REFERENCED:
            assert r["identical_ids"] is True and r["tiktoken_ms_median"] > 0
            assert r["speedup"] == pytest.approx(r["tiktoken_ms_median"] / r["quicktok_ms_median"], rel=0.05)
        else:
            assert r["identical_ids"] is r["tiktoken_ms_median"] is r["speedup"] is None
    table = capsys.readouterr().out
    assert "quicktok ms" in table and "tiktoken ms" in table
    assert sum(line.split()[0] in (*REFERENCED, *BUNDLED) for line in table.splitlines() if line) == len(rows)
