"""Tokenize the bounded leading window of a prompt, remembering segments already seen.

tiktoken costs about 1.2 ms per 4,096 tokens here, more than the whole hot-path budget.
But prompts repeat: a tenant's system prompt, tool definitions and a conversation's history
come back in every request, and the chat template tokenizes each message as its own
segment (segment boundaries are token boundaries, see :mod:`gateway.tokens.chat_template`).  So a
bounded LRU maps ``xxh3_128(segment text)`` to its token ids (kept as a compact
``array('I')``, 4 bytes per token); only new segments reach the tokenizer.

The result is the first ``window`` tokens of ``chat_tokens(...)`` — what the simulator
counts — because the cache is pure memoization of ``tokenizer.encode``.  A segment that
reaches past the window is tokenized only over a leading part: for tiktoken encodings it is
cut at spaces, where cutting is provably exact, in chunks sized for the tokens still missing
(about 5 characters per token), so a cold 4,096-token window costs about one tokenizer pass
over 4,096 tokens rather than over 8 characters per token.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash

from gateway.tokens.alignment import Alignment, alignment_for_family, alignment_for_setting, resolve
from gateway.tokens.chat_template import GENERIC, ChatTemplate, SpecialToken
from gateway.tokens.tokenizer import Tokenizer


class SegmentTokenCache:
    """LRU of segment text hash -> token ids, bounded by the total number of tokens held."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int) -> None:
        self._encode = tokenizer.encode
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, array[int]] = OrderedDict()
        self._held = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens_held(self) -> int:
        return self._held

    def encode(self, text: str) -> array[int]:
        """Token ids of ``text`` (a cached array: callers must not modify it)."""
        if self.max_tokens <= 0:
            return array("I", self._encode(text))
        key = xxhash.xxh3_128_intdigest(text.encode("utf-8", "surrogatepass"))
        entries = self._entries
        hit = entries.get(key)
        if hit is not None:
            entries.move_to_end(key)
            self.hits += 1
            return hit
        self.misses += 1
        tokens = array("I", self._encode(text))
        if len(tokens) <= self.max_tokens:
            entries[key] = tokens
            self._held += len(tokens)
            while self._held > self.max_tokens:
                _, old = entries.popitem(last=False)
                self._held -= len(old)
        return tokens


class WindowTokenizer:
    """Leading-window token ids for chat messages (rendered with ``template``) and completion prompts."""

    def __init__(self, tokenizer: Tokenizer, window: int, cache_tokens: int, template: ChatTemplate = GENERIC) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.window = window
        self.cache = SegmentTokenCache(tokenizer, cache_tokens)
        # The tiktoken-style pre-tokenizers (cl100k, o200k, llama3, qwen) always start a new
        # pre-token at a space that follows a non-space, and BPE never merges across
        # pre-tokens: cutting there is exact.  A Hugging Face tokenizer gives no such guarantee.
        self._exact_cuts = bool(getattr(tokenizer, "splits_at_spaces", False))

    def segments(self, segments: Iterable[str]) -> array[int]:
        """The first ``window`` tokens of the concatenated segments (each tokenized on its own)."""
        return self.measured(segments)[0]

    def measured(self, segments: Iterable[str]) -> tuple[array[int], float | None]:
        """:meth:`segments`, and the UTF-8 bytes per token of the text tokenized for them.

        The window is exact; the rest of a long prompt is only estimated, from its length in
        bytes.  Text runs anywhere from ~2 bytes per token (CJK, dense code) to 7 (whole words
        drawn from a vocabulary), so the window's own ratio estimates the rest of *this*
        prompt better than any constant (None: no text was tokenized).
        """
        window = self.window
        encode = self.cache.encode
        out: array[int] = array("I")
        text_bytes = text_tokens = 0
        for segment in segments:
            remaining = window - len(out)
            if remaining <= 0:
                break
            if type(segment) is SpecialToken:  # a template's special token: its id, never BPE
                out.append(segment.id)
                continue
            if len(segment) > remaining * _CHARS_PER_TOKEN_GUESS + 64:
                ids, used = self._leading(segment, remaining)
            else:
                ids, used = encode(segment), len(segment)
            out.extend(ids)
            text_tokens += len(ids)
            if segment.isascii():  # O(1): CPython keeps the flag
                text_bytes += used
            else:
                text_bytes += len(segment[:used].encode("utf-8", "surrogatepass"))
        if len(out) > window:
            del out[window:]
        return out, (text_bytes / text_tokens if text_tokens else None)

    def _leading(self, segment: str, wanted: int) -> tuple[array[int], int]:
        """At least the first ``wanted`` tokens of a long segment, tokenizing little more, and
        how many characters of it those tokens cover.

        With exact cuts the segment is tokenized in chunks that end at a space after a
        non-space, so the concatenation equals tokenizing the whole segment; each chunk is
        sized for the tokens still missing.  Otherwise (or when no such space is near) the
        rule of :func:`gateway.tokens.chat_template.encode_segments` applies: tokenize a leading slice
        of 8 characters per token and trust all but its last two tokens.
        """
        encode = self.cache.encode
        out: array[int] = array("I")
        pos = 0
        n = len(segment)
        while len(out) < wanted and pos < n:
            need = wanted - len(out)
            end = pos + need * _CHARS_PER_TOKEN_GUESS + 64
            if end >= n:
                out.extend(encode(segment[pos:]))
                pos = n
                break
            cut = _space_cut(segment, pos, end) if self._exact_cuts else -1
            if cut > pos:
                out.extend(encode(segment[pos:cut]))
                pos = cut
                continue
            budget = need * 8 + 64
            if pos + budget < n:
                partial = encode(segment[pos : pos + budget])
                if len(partial) - 2 >= need:
                    out.extend(partial[:need])
                    # the slice's characters in proportion to the tokens kept
                    pos += budget * need // len(partial)
                    break
            out.extend(encode(segment[pos:]))
            pos = n
            break
        return out, pos

    def chat(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> array[int]:
        return self.chat_measured(messages, tools)[0]

    def chat_measured(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None
    ) -> tuple[array[int], float | None]:
        """:meth:`chat` and its bytes per token (see :meth:`measured`).

        A template that can render only the leading messages the window needs does
        (``leading_window``: ``hf:DIR`` templates, :mod:`gateway.tokens.prefix_render`).
        """
        leading = getattr(self.template, "leading_window", None)
        if leading is not None:
            found = leading(messages, tools, self.window, self.measured)
            if found is not None:
                return found  # type: ignore[no-any-return]
        return self.measured(self.template.segments(messages, tools))

    def text(self, prompt: str) -> array[int]:
        """A completion prompt string: one segment (after the model's BOS when vLLM adds one)."""
        return self.text_measured(prompt)[0]

    def text_measured(self, prompt: str) -> tuple[array[int], float | None]:
        """:meth:`text` and its bytes per token (see :meth:`measured`)."""
        prefix = getattr(self.template, "completion_prefix", ())
        split = getattr(self.template, "split_text", None)
        pieces = split(prompt) if split is not None else (prompt,)  # specials parsed, as vLLM does
        return self.measured((*prefix, *pieces) if prefix and prompt else pieces)

    def ids(self, prompt: Sequence[int]) -> array[int]:
        """A completion prompt given as token ids: the leading window as is."""
        return array("I", prompt[: self.window])


class ModelWindows:
    """The window tokenizer for each request's model under a route's ``tokenizer`` setting.

    With ``auto`` the served model's name picks the vocabulary and chat template
    (:mod:`gateway.tokens.alignment`); one :class:`WindowTokenizer` (and segment cache) exists per
    alignment, and model names are memoized (bounded) so resolving costs one dict lookup.
    A fixed setting (an encoding name or ``hf:DIR``) is loaded here, at route build time, so a
    bad one fails at startup.
    """

    MAX_MODELS = 1024  # distinct model names memoized; more are resolved on each request

    def __init__(self, setting: str, window: int, cache_tokens: int) -> None:
        self.setting = setting
        self.window = window
        self._cache_tokens = cache_tokens
        self._by_key: dict[str, WindowTokenizer] = {}
        self._by_model: dict[str, WindowTokenizer] = {}
        fixed = alignment_for_setting(setting)
        self._fixed = self._window_for(fixed) if fixed is not None else None
        self._last = self._fixed

    def _window_for(self, alignment: Alignment) -> WindowTokenizer:
        wt = self._by_key.get(alignment.key)
        if wt is None:
            wt = WindowTokenizer(alignment.tokenizer, self.window, self._cache_tokens, alignment.template)
            wt.alignment = alignment  # type: ignore[attr-defined]
            self._by_key[alignment.key] = wt
        return wt

    def for_model(self, model: str) -> WindowTokenizer:
        if self._fixed is not None:
            return self._fixed
        wt = self._by_model.get(model)
        if wt is None:
            wt = self._window_for(resolve(self.setting, model))
            if len(self._by_model) < self.MAX_MODELS:
                self._by_model[model] = wt
        self._last = wt
        return wt

    def _current(self) -> WindowTokenizer:
        if self._last is None:
            self._last = self._window_for(alignment_for_family("cl100k_base"))
        return self._last

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer of the last request's model (for tools and benchmarks)."""
        return self._current().tokenizer

    @property
    def cache(self) -> SegmentTokenCache:
        """The segment cache of the last request's model (for tools and benchmarks)."""
        return self._current().cache


# Chunk size per missing token: English runs ~4.2 characters per cl100k token; a short
# chunk costs one more small tokenizer call, a long one tokenizes text past the window.
_CHARS_PER_TOKEN_GUESS = 5
_CUT_SEARCH = 1024  # how far back from the chunk end a space is looked for


def _space_cut(text: str, lo: int, hi: int) -> int:
    """The last index in (lo, hi] holding a space preceded by a non-space, or -1."""
    floor = max(lo + 1, hi - _CUT_SEARCH)
    p = text.rfind(" ", floor, hi + 1)
    while p >= floor:
        if not text[p - 1].isspace():
            return p
        p = text.rfind(" ", floor, p)
    return -1
