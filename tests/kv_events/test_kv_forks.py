"""Forks inside a text chunk: chunk prints (``prefix.fork_bytes``), what TextTail keeps of
them per replica, and the precise prediction that reads them."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.kv_events.text_tail import TextTail
from gateway.prefix.blocks import chain_text_keys
from gateway.prefix.pipeline import PrefixPipeline
from gateway.prefix.settings import NormalizeSettings, PrefixSettings
from gateway.routing.routes import request_view
from tests.kv_events.frames import cleared
from tests.kv_events.test_kv_index import _events
from tests.kv_events.test_kv_policy import BS, MODEL, _engine_holds, _setup, _views

MARK = 2  # the message mark before a completions prompt's text (gateway.prefix.blocks)


def _text(n_bytes: int, seed: int) -> str:
    rnd = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_bytes:
        word = f"{rnd.choice(['tide', 'reef', 'kelp', 'gull'])}{rnd.randrange(1000)} "
        out.append(word)
        size += len(word)
    return "".join(out)[:n_bytes]


# --- prints ---------------------------------------------------------------------------------------
def test_each_chunk_prints_its_pieces_but_the_last_and_the_keys_do_not_change() -> None:
    text = _text(3000, 1)
    plain = chain_text_keys([(text,)], 7, 1024)
    printed = chain_text_keys([(text,)], 7, 1024, print_bytes=128)
    assert printed.keys == plain.keys and printed.ends == plain.ends
    assert plain.prints == [b"", b"", b""]
    sizes = [len(p) // 4 for p in printed.prints]
    assert sizes == [7, 7, (3000 + MARK - 2048 + 127) // 128 - 1]  # full chunks: 8 pieces, the last one not printed


def test_with_a_tail_only_the_chunks_ending_in_the_texts_last_bytes_are_printed() -> None:
    text = _text(10_000, 5)
    every = chain_text_keys([(text,)], 7, 1024, print_bytes=128)
    tail = chain_text_keys([(text,)], 7, 1024, print_bytes=128, print_tail=3000)
    total = len(text) + MARK
    assert [bool(p) for p in tail.prints] == [end > total - 3000 for end in every.ends]
    kept = [p for p, end in zip(every.prints, every.ends, strict=True) if end > total - 3000]
    assert [p for p in tail.prints if p] == kept


def test_two_texts_that_part_inside_a_chunk_share_the_prints_before_the_piece_they_part_in() -> None:
    head = _text(1024 + 300 - MARK, 2)  # they part 300 bytes into the second chunk
    a = chain_text_keys([(head + "first ending " * 60,)], 7, 1024, print_bytes=128)
    b = chain_text_keys([(head + "another close " * 60,)], 7, 1024, print_bytes=128)
    assert a.keys[0] == b.keys[0] and a.keys[1] != b.keys[1]
    assert a.prints[1][:8] == b.prints[1][:8]  # pieces 0-255 agree
    assert a.prints[1][8:12] != b.prints[1][8:12]  # piece 256-383 holds where they part


def test_print_bytes_must_divide_the_chunk_and_an_explicit_setting_is_checked() -> None:
    with pytest.raises(ValueError):
        chain_text_keys([("x" * 2000,)], 0, 1024, print_bytes=100)
    with pytest.raises(ValidationError, match="fork_bytes"):
        PrefixSettings(fork_bytes=100)
    assert PrefixSettings(chunk_bytes=1000).print_bytes == 0  # the default 128 does not divide it: none
    assert PrefixSettings().print_bytes == 128 and PrefixSettings(fork_bytes=0).print_bytes == 0


# --- TextTail ---------------------------------------------------------------------------------------
def _prints(*marks: int) -> bytes:
    return b"".join(m.to_bytes(4, "little") for m in marks)


def test_text_tail_counts_the_pieces_a_chunk_shares_with_the_one_that_followed_on_that_replica() -> None:
    tail = TextTail()
    # keys 10, 11, 12 with their chunks' prints; 9: the window's last token block key
    tail.record("r0", [10, 11, 12], [_prints(1, 2), _prints(3, 4, 5), _prints(6)], after=9)
    assert tail.fork("r0", 10, _prints(3, 4, 5)) == 3  # the chunk after key 10: all its pieces
    assert tail.fork("r0", 10, _prints(3, 4, 8)) == 2
    assert tail.fork("r0", 10, _prints(3)) == 1  # a shorter chunk: as far as it goes
    assert tail.fork("r0", 10, _prints(7)) == 0
    assert tail.fork("r0", 9, _prints(1, 9)) == 1  # the first chunk, after the window
    assert tail.fork("r0", 11, _prints(6)) == 1
    assert tail.fork("r1", 10, _prints(3, 4, 5)) == 0  # another replica holds none of it
    assert tail.fork("r0", 12, _prints(6)) == 0  # nothing followed the last key
    tail.forget("r0")  # its engine cleared its cache
    assert tail.fork("r0", 10, _prints(3, 4, 5)) == 0


def test_a_cleared_replica_keeps_no_prints_for_a_key_recorded_again_without_a_successor() -> None:
    tail = TextTail()
    tail.record("r0", [10, 11], [_prints(1), _prints(2, 3)], after=9)
    tail.record("r1", [10, 11], [_prints(1), _prints(2, 3)], after=9)
    tail.forget("r0")  # its engine reset its cache
    tail.record("r0", [10], [_prints(1)], after=9)  # a prompt that ends at key 10
    assert tail.fork("r0", 10, _prints(2, 3)) == 0  # what followed 10 before the reset is gone
    assert tail.fork("r0", 9, _prints(1)) == 1
    assert tail.fork("r1", 10, _prints(2, 3)) == 2  # another replica keeps its own


def test_text_tail_withdraw_and_its_bound_take_the_prints_too() -> None:
    tail = TextTail(max_keys=4)
    tail.record("r0", [10, 11], [_prints(1), _prints(2)], after=9)
    tail.withdraw("r0", [10, 11], after=9)
    assert tail.fork("r0", 9, _prints(1)) == 0 and tail.fork("r0", 10, _prints(2)) == 0
    for n in range(20):
        tail.record("r1", [100 + n, 200 + n], [_prints(n), _prints(n + 1)], after=300 + n)
    assert len(tail) <= 4 and len(tail._next) <= 4
    assert tail.fork("r1", 319, _prints(19)) == 1  # the latest survive


# --- the precise prediction -------------------------------------------------------------------------
def _pipeline(forks: bool) -> PrefixPipeline:
    pipe = PrefixPipeline(NormalizeSettings(mode="off"), PrefixSettings(window_tokens=64))
    pipe.fork_gate = (lambda: True) if forks else None
    return pipe


def _body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt}


def test_a_question_on_a_held_document_is_predicted_to_where_it_parts_inside_a_chunk() -> None:
    document = _text(5 * 1024 + 900 - MARK, 3)  # ends 900 bytes into its sixth chunk
    first_q, second_q = " Which gull nested first, and where?" * 3, " Who counted the kelp?"
    predicted: dict[bool, int] = {}
    for forks in (True, False):
        policy, events, _clock = _setup(speculative_s=0)
        pipe = _pipeline(forks)

        def view(prompt: str, pipe: PrefixPipeline = pipe) -> Any:
            return request_view("route", "completions", _body(prompt), pipe.prepare("completions", _body(prompt)))

        first = policy.choose(view(document + first_q), _views())
        window = list(pipe.window_tokens("completions", _body(document + first_q)))
        _engine_holds(events, first.replica, window[: len(window) // BS * BS], 1)  # the engine holds the window
        second = view(document + second_q)
        decision = policy.peek(second, _views())
        assert decision.replica == first.replica and decision.detail["kv_mode"] == "precise"
        predicted[forks] = decision.detail["predicted_cached_tokens"]
        if forks:
            forks_of = second.key_forks
            assert forks_of is not None and len(forks_of.prints) == len(second.key_tokens)
            # where the document ends, at the estimate's own count (the chunk's ends interpolated)
            index = next(i for i, end in enumerate(forks_of.ends) if end > len(document) + MARK)
            parted = forks_of.tokens_at(index, 900 / 128, second.key_tokens)  # the document's end
            # 7 pieces agree, the 8th holds the end: its middle, floored to a block
            assert parted - 2 * BS <= predicted[forks] <= parted + BS
            assert policy.peek(view(document + first_q), _views()).detail["predicted_cached_tokens"] > parted
            events.ingestor.ingest(first.replica, 0, 2, _events(cleared()))  # the engine lost it all
            assert policy.peek(second, _views()).detail["predicted_cached_tokens"] == 0
    assert predicted[True] - predicted[False] >= 150  # chunk resolution stops ~900 bytes short


def test_without_a_precise_replica_the_pipeline_computes_no_prints() -> None:
    prompt = _text(4000, 4)
    assert _pipeline(False).prepare("completions", _body(prompt)).text_forks is None
    prepared = _pipeline(True).prepare("completions", _body(prompt))
    assert prepared.text_forks is not None and len(prepared.text_forks.prints) == len(prepared.text_keys)
