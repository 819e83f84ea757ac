"""The simulator's prompt tokenization: its fast paths give exactly what the plain ones give."""

from __future__ import annotations

import random

import pytest

from gateway.sim.tokenizer import _TEMPLATE_TOKENS, PromptBuilder, SimTokenizer, _compiled

VOCABULARIES = ["llama3", "qwen3", "cl100k_base", "o200k_base"]


def _reference(builder: PromptBuilder, text: str) -> list[int]:
    """with_specials as it was written first: split on the alternation of every special
    (longest first), BPE each text run."""
    assert builder._special_re is not None
    specials = builder.tokenizer.specials
    out: list[int] = []
    for piece in builder._special_re.split(text):
        if piece:
            special = specials.get(piece)
            out.extend([special] if special is not None else builder.tokenizer.encode(piece))
    return out


@pytest.mark.parametrize("vocab", VOCABULARIES)
def test_bracketed_split_matches_the_alternation(vocab: str) -> None:
    tokenizer = SimTokenizer(vocab)
    builder = PromptBuilder(tokenizer, tokenizer.encode)
    assert builder._bracketed  # every bundled vocabulary's specials are <...>: the fast path is taken
    specials = sorted(tokenizer.specials)
    rng = random.Random(vocab)
    # Specials, their halves and near misses, stray brackets and bars, text, non-ASCII.
    alphabet = ["<", ">", "|", "<|", "|>", "</", "<<", ">>", "a", " ", "\n", "é", "😀", "\ud800", "user"]
    alphabet += rng.sample(specials, min(25, len(specials)))
    alphabet += [s[:-1] for s in specials[:8]] + [s[1:] for s in specials[:8]] + [s[:-1] + "x>" for s in specials[:4]]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        assert builder.with_specials(text) == _reference(builder, text), repr(text)
    markup = "<b>x</b> a < b " * 40 + specials[0]  # past _BRACKETED_MAX "<": the alternation's C scan
    fixed = ("", "<", ">", "<>", "<<|eot_id|>>", "<|im_start|><|im_start|", "x" * 300 + "<|endoftext|>" + "y")
    for text in (*fixed, markup):
        assert builder.with_specials(text) == _reference(builder, text), repr(text)


@pytest.mark.parametrize("vocab", ["llama3", "qwen3"])
def test_rendered_chat_tokens_match_the_alternation(vocab: str) -> None:
    tokenizer = SimTokenizer(vocab)
    builder = PromptBuilder(tokenizer, tokenizer.encode)
    messages = [
        {"role": "system", "content": "Be brief. <|eot_id|> and <think> are text here."},
        {"role": "user", "content": "Hello! <b>bold</b> a<|b|>c"},
    ]
    template = _compiled(vocab)
    assert isinstance(template.globals, dict)  # flattened once, not a ChainMap per render
    text = template.render(messages=messages, add_generation_prompt=True, tools=None)
    assert builder.with_specials(text) == _reference(builder, text)
    rendered = template.render(messages=messages, tools=None, add_generation_prompt=True, **_TEMPLATE_TOKENS[vocab])
    assert builder.chat(messages) == _reference(builder, rendered)


def test_a_vocabulary_with_other_specials_keeps_the_alternation() -> None:
    tokenizer = SimTokenizer("cl100k_base")
    tokenizer.specials = {**tokenizer.specials, "[SEP]": 100001, "<a>b>": 100002}
    builder = PromptBuilder(tokenizer, tokenizer.encode)
    assert not builder._bracketed
    text = "x[SEP]y<a>b><|endoftext|>z"
    assert builder.with_specials(text) == _reference(builder, text)
    assert 100001 in builder.with_specials(text) and 100002 in builder.with_specials(text)
