"""The served models' real chat templates, rendered in Python as token-boundary segments.

vLLM renders a model's Jinja ``chat_template`` and tokenizes the whole string, with the
vocabulary's special tokens parsed out first.  To predict the same block boundaries we must
produce the same string *and* know where the special tokens are: these renderers rebuild the
published templates (Llama 3.1/3.3, Qwen2.5, Qwen3) statement by statement, and emit each
text run between two special tokens as one segment (BPE never crosses a special token, so a
run tokenizes the same alone; two pieces of one run might not, so runs are never split).
Tests render the published templates with jinja2 and compare byte for byte.

Message content is always ordinary text, even when it contains a special-token look-alike
(vLLM's tokenizer would parse one there; we keep user text from forging template markup).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from gateway.tokens.chat_template import SpecialToken
from gateway.tokens.tokenizer import Tokenizer, TokenizerUnavailable


class Runs:
    """Collects template output; flushes the pending text run at each special token."""

    __slots__ = ("_buf", "_out", "_specials", "_split")

    def __init__(self, specials: dict[str, SpecialToken], split: re.Pattern[str]) -> None:
        self._specials = specials
        self._split = split
        self._buf: list[str] = []
        self._out: list[str] = []

    def lit(self, text: str) -> None:
        """Template literal text: special-token strings in it are special tokens."""
        for piece in self._split.split(text):
            if not piece:
                continue
            special = self._specials.get(piece)
            if special is not None:
                self.special(special)
            else:
                self._buf.append(piece)

    def text(self, text: str) -> None:
        """Message content: always ordinary text."""
        if text:
            self._buf.append(text)

    def special(self, token: SpecialToken) -> None:
        if self._buf:
            self._out.append("".join(self._buf))
            self._buf.clear()
        self._out.append(token)

    def drain(self) -> list[str]:
        """The segments completed so far (the pending text run stays pending)."""
        out, self._out = self._out, []
        return out

    def finish(self) -> list[str]:
        if self._buf:
            self._out.append("".join(self._buf))
            self._buf.clear()
        return self.drain()


def special_tokens(tokenizer: Tokenizer, names: Iterable[str]) -> tuple[dict[str, SpecialToken], re.Pattern[str]]:
    """The template's special tokens with their ids, and a regex splitting literals at them."""
    table: dict[str, SpecialToken] = {}
    for name in names:
        token_id = tokenizer.special_id(name)
        if token_id is None:
            raise TokenizerUnavailable(f"tokenizer {tokenizer.name!r} has no special token {name!r}")
        table[name] = SpecialToken(name, token_id)
    pattern = re.compile("(" + "|".join(re.escape(n) for n in sorted(table, key=len, reverse=True)) + ")")
    return table, pattern
