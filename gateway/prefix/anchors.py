"""Exact prompt lengths learned from replies, for the keys past the token window.

Only the leading window is tokenized; past it the key chain runs over text chunks whose
token counts are estimated from their bytes at the window's own ratio.  On long agent and
tool-call prompts the rest of the text (tool output, JSON, code) tokenizes at another ratio
than the window (a system prompt), and the estimate misses by ~3 % of the prompt: so does
every prediction of cached tokens there, and the prefill work the load rules weigh.

The engine counts each prompt exactly (``usage.prompt_tokens``).  A prompt past the window
ends on a text key that names everything before it, and a message's last chunk ends at the
message's own end (:func:`~gateway.prefix.blocks.chain_text_keys`), so a conversation's next
turn holds that same key: learned from the reply, ``key -> prompt_tokens`` tells the next
turn exactly how many tokens precede its new messages — the depth its previous turn left in
the engine's cache.  The count includes the generation prompt (the assistant header), which
the next turn's assistant message starts with, so a conversation that goes on (the common
case) is predicted to the token; a fork from that point (another role next) is off by those
few tokens.

New conversations behind a shared head (a long system prompt, tool definitions) fork at the
head's end, which is no served prompt's last key.  The first prompts behind it end a short
way past it (one user message), so the reply measures the head too, up to that short tail's
estimate: keys up to ``_BACK_TOKENS`` estimated tokens before the last are anchored as well,
each by the prompt that ended nearest past it (an exact anchor is never replaced by an
extrapolated one).

:class:`PromptAnchors` keeps a bounded LRU of such anchors per route (~150 bytes each);
:meth:`PromptAnchors.estimate` corrects a request's estimates by the anchors among its keys:
exact at each, interpolated between, and past the deepest the same correction (the new
text at the window's ratio, counted from the exact tokens before it).  Per gateway process:
a turn that lands on another pod counts as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# A reply whose prompt_tokens is this far from the gateway's own estimate measured something
# else (a truncated prompt, another tokenizer behind the same name, a bad usage object):
# learned, it would mislead every later turn.
_SANE_RATIO = (0.5, 2.0)
# Keys this many estimated tokens before a measured prompt's end are anchored too (at the
# measured count less the estimated tokens between): a user turn, a tool result.
_BACK_TOKENS = 1024


class PromptAnchors:
    """``text key -> exact prompt tokens`` up to that key, learned from replies (bounded LRU)."""

    __slots__ = ("_by_key", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_key: OrderedDict[int, tuple[int, int]] = OrderedDict()  # key -> (tokens, tokens extrapolated)

    def __len__(self) -> int:
        return len(self._by_key)

    def learn(
        self, keys: Sequence[int], key_tokens: Sequence[int], prompt_tokens: int, estimate: int, floor: int
    ) -> int:
        """A served prompt whose last keys are ``keys`` (tokens up to each, estimated:
        ``key_tokens``; the whole prompt: ``estimate``) measured ``prompt_tokens``; how many
        keys it anchored (0: disabled, or out of the sane range).  Keys estimated at no more
        than ``floor`` (the token window: their text lies inside it, their estimate is the
        window's) tell nothing and are not anchored."""
        if self.capacity <= 0 or prompt_tokens <= 0 or estimate <= 0 or not keys or len(keys) != len(key_tokens):
            return 0
        low, high = _SANE_RATIO
        if not low * estimate <= prompt_tokens <= high * estimate:
            return 0
        by_key = self._by_key
        end = key_tokens[-1]
        learned = 0
        for i in range(len(keys) - 1, -1, -1):
            back = end - key_tokens[i]
            if back > _BACK_TOKENS or key_tokens[i] <= floor:
                break
            key = keys[i]
            known = by_key.get(key)
            if known is None or back <= known[1]:
                by_key[key] = (prompt_tokens - back, back)
                learned += 1
            by_key.move_to_end(key)
        while len(by_key) > self.capacity:
            by_key.popitem(last=False)
        return learned

    def estimate(self, keys: Sequence[int], ends: Sequence[int], tokens: list[int], floor: int) -> int | None:
        """Correct ``tokens`` (per key, estimated from ``ends``, its byte ends, and never less
        than ``floor``) in place by the anchors among ``keys``; the corrected tokens at the
        last key, or None (no anchor applies).

        Each anchor says by how much the estimate is off there.  The correction is
        interpolated over bytes between two anchors, grows from none (at the window) to the
        first, and stays the deepest one's past it: new text is estimated at the window's
        ratio, from the exact count before it.  Tokens never decrease along the chain.
        """
        by_key = self._by_key
        if not by_key or not keys:
            return None
        points: list[tuple[int, int]] = []  # (index, correction) of anchored keys past the floor
        for i, key in enumerate(keys):
            known = by_key.get(key)
            if known is not None and tokens[i] > floor:
                points.append((i, known[0] - tokens[i]))
        if not points:
            return None
        first = next(i for i in range(len(keys)) if tokens[i] > floor)
        start_i, start_bytes, start_fix = first - 1, ends[first - 1] if first else 0, 0
        for i, fix in points:
            span = ends[i] - start_bytes
            for j in range(start_i + 1, i):
                tokens[j] += start_fix + (fix - start_fix) * (ends[j] - start_bytes) // span
            tokens[i] += fix
            start_i, start_bytes, start_fix = i, ends[i], fix
        for j in range(start_i + 1, len(keys)):
            tokens[j] += start_fix
        highest = floor
        for j in range(first, len(keys)):  # monotone, never under the window
            highest = tokens[j] = max(tokens[j], highest)
        return tokens[-1]
