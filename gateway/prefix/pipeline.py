"""Turn a request body into what routing needs: (normalized body, token window, block keys).

This runs once per request, before any policy, and never reaches back afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.chat_template import chat_tokens
from gateway.prefix.blocks import chain_block_keys, first_block_seed
from gateway.prefix.settings import NormalizeSettings, PrefixSettings
from gateway.tokenizer import get_tokenizer


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """The outcome of preparing one request body."""

    body: dict[str, Any]  # the body to forward (rewritten only when normalization relocated spans)
    block_keys: tuple[int, ...]  # chained keys of the full blocks of the leading window
    block_size: int
    window_tokens: int  # tokens in the leading window that was tokenized
    normalized: dict[str, int] = field(default_factory=dict)  # rule name -> spans found (or moved)
    relocated: bool = False  # True when the body was rewritten


class PrefixPipeline:
    """Normalize → tokenize (bounded window) → hash, for one route's settings."""

    def __init__(self, normalize: NormalizeSettings, prefix: PrefixSettings) -> None:
        self.normalize_settings = normalize
        self.settings = prefix
        self._tokenizer = get_tokenizer(prefix.tokenizer)

    def prepare(self, endpoint: str, body: dict[str, Any]) -> PreparedPrompt:
        """``endpoint`` is "chat" or "completions"; other endpoints get no keys."""
        window = self.settings.window_tokens
        if endpoint == "chat":
            tokens = chat_tokens(self._tokenizer, body.get("messages") or [], body.get("tools"), max_tokens=window)
        elif endpoint == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                tokens = prompt[:window]
            elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                tokens = self._tokenizer.encode(prompt[0][: window * 8])[:window]
            elif isinstance(prompt, str):
                tokens = self._tokenizer.encode(prompt[: window * 8])[:window]
            else:
                tokens = []
        else:
            tokens = []
        tokens = tokens[:window]
        seed = first_block_seed(str(body.get("model", "")), None, body.get("cache_salt"))
        keys = chain_block_keys(tokens, self.settings.block_size, seed)
        return PreparedPrompt(
            body=body, block_keys=tuple(keys), block_size=self.settings.block_size, window_tokens=len(tokens)
        )
