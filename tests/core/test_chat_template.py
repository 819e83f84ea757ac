"""The shared chat template: segment-wise tokenization, bounded windows that agree with full renders."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tokens.chat_template import chat_tokens, render_content, render_message
from gateway.tokens.tokenizer import get_tokenizer

TOKENIZER = get_tokenizer()


def test_render_message_and_parts() -> None:
    assert render_message({"role": "user", "content": "hi"}) == "<|im_start|>user\nhi<|im_end|>\n"
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x/i.png"}}]
    assert render_content(parts) == "a<|image_url|>http://x/i.png"
    assert render_message({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}).endswith(
        '[{"id":"1"}]<|im_end|>\n'
    )


def test_leading_tokens_do_not_depend_on_later_messages() -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    a = chat_tokens(TOKENIZER, [system, {"role": "user", "content": "first question"}])
    b = chat_tokens(TOKENIZER, [system, {"role": "user", "content": "a different question"}])
    shared = len(chat_tokens(TOKENIZER, [system], add_generation_prompt=False))
    assert a[:shared] == b[:shared] and a != b


@settings(max_examples=60, deadline=None)
@given(
    texts=st.lists(st.text(min_size=0, max_size=400), min_size=1, max_size=4),
    window=st.integers(min_value=1, max_value=300),
)
@pytest.mark.slow
def test_bounded_window_is_a_prefix_of_the_full_render(texts: list[str], window: int) -> None:
    messages = [{"role": "user", "content": t} for t in texts]
    full = chat_tokens(TOKENIZER, messages)
    bounded = chat_tokens(TOKENIZER, messages, max_tokens=window)
    assert bounded[:window] == full[: min(window, len(full))]
    assert len(bounded) >= min(window, len(full))
