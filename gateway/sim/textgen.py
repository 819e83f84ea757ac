"""Deterministic "model output": filler words chosen by a hash of (seed, prompt, choice).

Two properties matter more than the words themselves:

- the same seed and prompt always give the same text (temperature-0-like), so tests and
  benchmarks are reproducible;
- every output token is one whole word that the tokenizer encodes back to exactly the
  same token, so when a client sends the reply back in the next chat turn, the prompt's
  tokens continue the cached sequence (prompt + output) exactly as with a real model.
  That is what makes multi-turn hit rates realistic.

Except, on purpose, now and then: a real model's sampled ids are often not the ids its text
encodes back to (a word produced in two pieces), so the next turn's prompt, re-tokenized,
leaves the cached sequence at that word.  With ``drift`` > 0 each output word is, with that
probability, emitted as two tokens whose text is the word (`` wat`` + ``er``): the reply
reads the same and the following turn hits the cache only up to the block before it.
"""

from __future__ import annotations

from array import array

import xxhash

from gateway.sim.tokencache import Tokenizer

_OPENERS = "Sure The This Here Yes It In We That There Okay Well So As For To".split()  # noqa: SIM905
_WORDS = " ".join(
    (
        "the of and to in is you that it he was for on are as with his they at be this have from",
        "or one had by word but not what all were we when your can said there use an each which she",
        "do how their if will up other about out many then them these so some her would make like",
        "him into time has look two more write go see number no way could people my than first water",
        "been call who oil its now find long down day did get come made may part",
    )
).split()

_MASK = (1 << 64) - 1


class TextGenerator:
    """Maps (seed, prompt tokens, choice index, n) to output token ids and their text."""

    def __init__(self, tokenizer: Tokenizer, seed: int, drift: float = 0.0) -> None:
        self.seed = seed & _MASK
        self.drift_threshold = int(drift * (1 << 53))
        self.openers = self._single_tokens(tokenizer, _OPENERS, prefix="")
        self.words = self._single_tokens(tokenizer, _WORDS, prefix=" ")
        if not self.words:  # an unusual tokenizer: fall back to whatever one token decodes to
            ids = tokenizer.encode(" the")
            self.words = [ids[0]]
        if not self.openers:
            self.openers = list(self.words)
        self.text: dict[int, str] = {i: tokenizer.decode([i]) for i in (*self.openers, *self.words)}
        self.splits = self._two_piece_words(tokenizer, self.words, self.text) if drift > 0 else {}
        for a, b in self.splits.values():
            self.text.setdefault(a, tokenizer.decode([a]))
            self.text.setdefault(b, tokenizer.decode([b]))

    @staticmethod
    def _single_tokens(tokenizer: Tokenizer, words: list[str], prefix: str) -> list[int]:
        out: list[int] = []
        for word in words:
            ids = tokenizer.encode(prefix + word)
            if len(ids) == 1 and ids[0] not in out:
                out.append(ids[0])
        return out

    @staticmethod
    def _two_piece_words(tokenizer: Tokenizer, words: list[int], text: dict[int, str]) -> dict[int, tuple[int, int]]:
        """Words that two single tokens also spell, each re-encoding to the one word token."""
        out: dict[int, tuple[int, int]] = {}
        for word in words:
            spelled = text[word]
            for cut in range(2, len(spelled) - 1):
                head, tail = tokenizer.encode(spelled[:cut]), tokenizer.encode(spelled[cut:])
                if len(head) == 1 and len(tail) == 1 and tokenizer.encode(spelled) == [word]:
                    out[word] = (head[0], tail[0])
                    break
        return out

    def prompt_digest(self, prompt: list[int]) -> int:
        return xxhash.xxh3_64_intdigest(array("I", prompt).tobytes(), seed=self.seed)

    def token_ids(self, digest: int, choice: int, n: int) -> list[int]:
        """``n`` output token ids; the first is a capitalized opener, then lower-case words."""
        if n <= 0:
            return []
        x = (digest ^ (choice * 0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) & _MASK
        openers, words = self.openers, self.words
        out = [openers[x % len(openers)]]
        nw = len(words)
        splits, threshold = self.splits, self.drift_threshold
        while len(out) < n:
            # xorshift64: cheap, deterministic, good enough to look like text
            x ^= (x << 13) & _MASK
            x ^= x >> 7
            x ^= (x << 17) & _MASK
            word = words[x % nw]
            pieces = splits.get(word) if threshold else None
            if pieces is not None and (x >> 11) < threshold and len(out) + 2 <= n:
                out.extend(pieces)
            else:
                out.append(word)
        return out

    def render(self, ids: list[int]) -> str:
        text = self.text
        return "".join([text[i] for i in ids])
