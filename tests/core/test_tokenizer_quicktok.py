"""quicktok (the hot path) must give exactly tiktoken's ids (the reference), whatever the text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tokens import tokenizer as tok

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return [i**2 for i in range(100)]  # 1+2+3==6\n\n\n",
    "日本語のトークナイザーは難しい。中文分词也是。한국어 텍스트도 있습니다.",
    "مرحبا بالعالم، هذا نص عربي مع أرقام ١٢٣ و 456.",
    "Emoji: 👩‍👩‍👧‍👦 🚀🔥👍🏽 ❤️ 🇫🇷 — and ZWJ sequences.",
    "Combining marks: e\u0301 a\u0300\u0301 \u0915\u094d\u0937 Zalgo: Z\u0351\u036b\u0343a\u0352l\u0350g\u033co\u0346",
    "Literal specials in user text: <|endoftext|> <|im_start|>user\nhi<|im_end|> <|fim_prefix|> <|endofprompt|>",
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n<|eot_id|>",
    "   leading\n\ttabs and  spaces   \r\n windows lines \r\n",
    "ALLCAPS lowercase MixedCase 1234567890 3.14159 0xDEADBEEF 99.99% don't I'LL we've",
    "https://example.com/path?q=1&x=2#frag <html><body>x</body></html>",
    "Ω≈ç√∫ Икс हिन्दी ไทย עברית ελληνικά",
    "",
    " " * 300 + "x" + "\n" * 50,
    "a" * 5000,
    "lone surrogate \ud800 in JSON",
]


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
def test_quicktok_ids_equal_tiktoken_on_corpus(name: str) -> None:
    fast = tok.get_tokenizer(name)
    ref = tok.get_reference_tokenizer(name)
    assert isinstance(fast, tok.QuicktokTokenizer), "quicktok must be the hot-path tokenizer"
    for text in CORPUS:
        assert fast.encode(text) == ref.encode(text), text[:40]


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
def test_special_look_alikes_are_ordinary_text(name: str) -> None:
    fast = tok.get_tokenizer(name)
    for special in ("<|endoftext|>", "<|endofprompt|>"):
        sid = fast.special_id(special)
        assert sid is not None
        ids = fast.encode(f"user says {special} here")
        assert sid not in ids and len(ids) > 3


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_open_model_vocabularies_are_offline_and_keep_specials_out_of_text(name: str) -> None:
    fast = tok.get_tokenizer(name)
    marker = "<|eot_id|>" if name == "llama3" else "<|im_start|>"
    sid = fast.special_id(marker)
    assert sid is not None and sid > 100_000
    ids = fast.encode(f"before {marker} after")
    assert sid not in ids
    assert fast.decode(ids) == f"before {marker} after"


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=300))
def test_quicktok_matches_tiktoken_on_arbitrary_unicode(text: str) -> None:
    for name in ("cl100k_base", "o200k_base"):
        assert tok.get_tokenizer(name).encode(text) == tok.get_reference_tokenizer(name).encode(text)


def test_falls_back_to_tiktoken_without_quicktok(monkeypatch) -> None:
    monkeypatch.setattr(tok, "_quicktok_encoding", lambda name: None)
    tok.get_tokenizer.cache_clear()
    try:
        assert isinstance(tok.get_tokenizer("cl100k_base"), tok.TiktokenTokenizer)
        with pytest.raises(tok.TokenizerUnavailable, match="pip install quicktok-v1"):
            tok.get_tokenizer("llama3")
    finally:
        tok.get_tokenizer.cache_clear()
