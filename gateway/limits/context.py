"""An early 400 for prompts that certainly cannot fit the target model's context window.

vLLM answers such a prompt with a 400 too, but only after the request crossed the network,
queued on a replica and was tokenized there; under load that is seconds of somebody else's
capacity.  Rejecting at the gateway is only allowed when it is *certain*: the gateway must
never refuse what the replica would have served.  (vLLM 0.32 serves a prompt that fits with
``max_tokens`` over the room left, clamping the output: only ``max_tokens`` alone over
``max_model_len`` is refused with it.)  So the prompt's length here is a lower
bound on its tokens in the model's own tokenizer:

- token-id prompts (``/v1/completions``, ``/v1/embeddings``): their length, exactly;
- the prefix pipeline's token count of the leading window, when the route tokenizes with the
  model's own vocabulary (``prefix.tokenizer: auto`` for a known family, or ``hf:DIR``; the
  pipeline then reports its units as ``exact (...)``): the prompt has at least those;
- any text: its UTF-8 bytes divided by ``limits.context_bytes_per_token`` (no token of
  cl100k/o200k covers more than 128 bytes, so the quotient is a true lower bound for them).

``max_model_len`` per model comes from the replicas' ``/v1/models`` (vLLM lists it); when
replicas disagree the largest wins (the request may reach any of them).  A model not listed
is never checked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gateway.errors import BadRequest


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"
    kind = "context_too_long"


def _text_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, list):
        return sum(_text_bytes(v) for v in value if isinstance(v, str))
    return 0


def _chat_bytes(messages: Any) -> int:
    total = 0
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            total += _text_bytes(content)
        elif isinstance(content, list):
            total += sum(_text_bytes(p.get("text")) for p in content if isinstance(p, dict))
    return total


def _id_lists(prompt: Any) -> Iterable[Sequence[Any]]:
    """The token-id prompts of a completions/embeddings input (one or a batch)."""
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], int):
            yield prompt
        elif isinstance(prompt[0], list):
            yield from (p for p in prompt if isinstance(p, list))


def _longest_prompt_bytes(prompt: Any) -> int:
    if isinstance(prompt, str):
        return _text_bytes(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return max(_text_bytes(p) for p in prompt)
    return 0


def prompt_tokens_lower_bound(
    endpoint: str, body: Mapping[str, Any], bytes_per_token: int, exact_window_tokens: int | None = None
) -> int:
    """Tokens the prompt has at least (for a batch: its longest prompt), in any tokenizer
    whose tokens cover at most ``bytes_per_token`` bytes."""
    if endpoint == "chat":
        lower = _chat_bytes(body.get("messages")) // bytes_per_token
    else:
        prompt = body.get("prompt" if endpoint == "completions" else "input")
        ids = max((len(p) for p in _id_lists(prompt)), default=0)
        lower = max(ids, _longest_prompt_bytes(prompt) // bytes_per_token)
    if exact_window_tokens:
        lower = max(lower, exact_window_tokens)
    return lower


def _requested_output(body: Mapping[str, Any]) -> int:
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


class ContextLimits:
    """``max_model_len`` per model, learned from the replicas' model listings."""

    def __init__(self, bytes_per_token: int) -> None:
        self.bytes_per_token = bytes_per_token
        self.max_len: dict[str, int] = {}

    def learn(self, listings: Iterable[tuple[Any, Iterable[Mapping[str, Any]]]]) -> None:
        """From ``ReplicaMonitor.models()``: ``(replica, entries)`` pairs."""
        table: dict[str, int] = {}
        for _replica, entries in listings:
            for entry in entries:
                model, length = entry.get("id"), entry.get("max_model_len")
                if isinstance(model, str) and isinstance(length, int) and not isinstance(length, bool) and length > 0:
                    table[model] = max(table.get(model, 0), length)
        if table:  # an empty listing (replicas briefly down) keeps what was known
            self.max_len = table

    def limit_for(self, model: Any) -> int | None:
        """``model``'s max_model_len as its replicas list it (None: not listed)."""
        return self.max_len.get(model) if isinstance(model, str) else None

    def check(self, endpoint: str, body: Mapping[str, Any], exact_window_tokens: int | None = None) -> None:
        """Raise :class:`ContextLengthExceeded` when the prompt certainly does not fit."""
        limit = self.limit_for(body.get("model"))
        if limit is None:
            return
        lower = prompt_tokens_lower_bound(endpoint, body, self.bytes_per_token, exact_window_tokens)
        output = _requested_output(body) if endpoint != "embeddings" else 0
        if lower >= limit if endpoint != "embeddings" else lower > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, your prompt has at least "
                f"{lower} tokens. Please reduce the length of the prompt.",
                param="messages" if endpoint == "chat" else "prompt" if endpoint == "completions" else "input",
            )
        # A prompt that fits with max_tokens over what is left is *served* by vLLM 0.32 (the output
        # clamped to the room left); only max_tokens alone over the window is refused everywhere.
        if output > limit:
            raise ContextLengthExceeded(
                f"max_tokens={output} cannot be greater than max_model_len={limit}. Please request fewer "
                "output tokens.",
                param="max_tokens",
            )
