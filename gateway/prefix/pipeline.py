"""Turn a request body into what routing needs: (normalized body, token window, block keys).

normalize (:mod:`.normalize`) → tokenize the bounded leading window (:mod:`.tokenize`) →
hash it into chained block keys (:mod:`.blocks`).  This runs once per request, before any
policy, and never reaches back afterwards.  One pipeline per route; everything is compiled
in the constructor.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from gateway.prefix.blocks import chain_block_keys, first_block_seed
from gateway.prefix.normalize import Normalizer, Relocation
from gateway.prefix.settings import NormalizeSettings, PrefixSettings
from gateway.prefix.tokenize import WindowTokenizer
from gateway.tokenizer import get_tokenizer

_CHARS_PER_TOKEN = 4  # estimate past the window (see PrefixPipeline._estimate_total)


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """The outcome of preparing one request body."""

    body: dict[str, Any]  # the body to forward (a new object only when normalization rewrote it)
    block_keys: tuple[int, ...]  # chained keys of the full blocks of the leading window
    block_size: int
    window_tokens: int  # tokens in the leading window that was tokenized
    prompt_tokens_estimate: int = 0  # whole prompt: exact when it fits the window or is token ids, else ~chars/4
    normalized: dict[str, int] = field(default_factory=dict)  # rule name -> spans found (report) or moved
    relocated: bool = False  # True when the body was rewritten (spans moved and/or tools canonicalized)
    spans_moved: int = 0  # volatile spans moved out of the stable prefix (0 in report mode)
    canonicalized: bool = False  # tool schemas were re-ordered
    changes: tuple[Relocation, ...] = ()  # the normalization diff, for /admin/explain only (holds prompt text)
    lora: str | None = None  # the LoRA adapter that went into the seed, if any


class PrefixPipeline:
    """Normalize → tokenize (bounded window) → hash, for one route's settings."""

    def __init__(self, normalize: NormalizeSettings, prefix: PrefixSettings) -> None:
        self.normalize_settings = normalize
        self.settings = prefix
        self.normalizer = Normalizer(normalize)
        self.tokens = WindowTokenizer(get_tokenizer(prefix.tokenizer), prefix.window_tokens, prefix.token_cache_tokens)

    def prepare(self, endpoint: str, body: dict[str, Any]) -> PreparedPrompt:
        """``endpoint`` is "chat" or "completions"; other endpoints get no keys."""
        result = self.normalizer.apply(endpoint, body)
        body = result.body
        tokens = self._window(endpoint, body)
        model = str(body.get("model", ""))
        lora: str | None = None
        if self.settings.lora_from_model:
            lora = model
            model = self.settings.base_model or model
        salt = body.get("cache_salt")
        seed = first_block_seed(model, lora, salt if isinstance(salt, str) else None)
        keys = chain_block_keys(tokens, self.settings.block_size, seed)
        return PreparedPrompt(
            body=body,
            block_keys=tuple(keys),
            block_size=self.settings.block_size,
            window_tokens=len(tokens),
            prompt_tokens_estimate=self._estimate_total(endpoint, body, len(tokens)),
            normalized=result.counts,
            relocated=result.rewritten,
            spans_moved=len(result.changes),
            canonicalized=result.canonicalized,
            changes=result.changes,
            lora=lora,
        )

    def _estimate_total(self, endpoint: str, body: dict[str, Any], window_tokens: int) -> int:
        """Tokens of the whole prompt, for the load signal (uncached prefill work queued).

        Only the leading window is tokenized (cost must not grow with the prompt), so past
        the window the rest is estimated from its length in characters: English averages
        about 4 characters per token in cl100k/o200k.  Token-id prompts are counted exactly.
        """
        if window_tokens < self.tokens.window:
            return window_tokens
        chars = 0
        if endpoint == "chat":
            for message in body.get("messages") or ():
                content = message.get("content") if isinstance(message, dict) else None
                if isinstance(content, str):
                    chars += len(content)
                elif isinstance(content, list):
                    texts = (p.get("text") for p in content if isinstance(p, dict))
                    chars += sum(len(t) for t in texts if isinstance(t, str))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
                prompt = prompt[0]
            if isinstance(prompt, list):
                return max(window_tokens, len(prompt))
            if isinstance(prompt, str):
                chars = len(prompt)
        return max(window_tokens, chars // _CHARS_PER_TOKEN)

    def _window(self, endpoint: str, body: dict[str, Any]) -> array[int]:
        if endpoint == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list):
                return array("I")
            return self.tokens.chat(messages, body.get("tools"))
        if endpoint == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
                prompt = prompt[0]  # a batch of prompts: key on the first one
            if isinstance(prompt, str):
                return self.tokens.text(prompt)
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt[: self.tokens.window]):
                try:
                    return self.tokens.ids(prompt)
                except OverflowError:  # ids outside u32: no keys rather than an error here
                    return array("I")
        return array("I")
