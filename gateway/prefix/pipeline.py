"""Turn a request body into what routing needs: (normalized body, token window, prefix keys).

normalize (:mod:`.normalize`) → tokenize the bounded leading window (:mod:`gateway.tokens.window`) →
hash it into chained block keys (:mod:`.blocks`) → continue the chain over the rest of the
prompt's text in character chunks (:func:`~gateway.prefix.blocks.chain_text_keys`), so two
prompts get different keys wherever they first differ, however deep, while only the window
pays for tokenization.  This runs once per request, before any policy, and never reaches
back afterwards.  One pipeline per route; everything is compiled in the constructor.

Bad input never raises here: content that cannot be rendered (deep nesting, odd types) is
keyed by what can be read, and a request with nothing readable gets no keys (the policy
then places it by load).
"""

from __future__ import annotations

import json
import logging
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.prefix.anchors import PromptAnchors
from gateway.prefix.block_size import BlockSizeChoice, choose
from gateway.prefix.blocks import MESSAGE_MARK, TextForks, chain_block_keys, chain_id_keys, chain_text_keys, engine_seed
from gateway.prefix.exactness import units_label
from gateway.prefix.identity import ModelIdentities
from gateway.prefix.normalize import Kept, Normalizer, NormalizeResult, Relocation
from gateway.prefix.settings import NormalizeSettings, PrefixSettings
from gateway.prefix.volatile import BLOCK_OPEN, our_blocks
from gateway.tokens.chat_template import Alignment
from gateway.tokens.window import ModelWindows

log = logging.getLogger("prefix_gateway")

_CHARS_PER_TOKEN = 4  # estimate past the window when the window measured none (see PrefixPipeline._continue)
# A measured ratio outside this range is a window of odd text (one long number, a base64
# blob): the rest of the prompt is less likely to share it than to be text.
_BYTES_PER_TOKEN_RANGE = (1.5, 8.0)


def _clamp_bytes_per_token(measured: float | None) -> float | None:
    if measured is None:
        return None
    low, high = _BYTES_PER_TOKEN_RANGE
    return min(high, max(low, measured))


_ID_CHUNK = 256  # token-id prompts past the window: ids per continuation key
# Our values block is looked for in the prompt's last few messages (the normalizer places it at
# the end) and counted in tokens up to this size (a block of a few dozen values).
_BLOCK_SEARCH = 3
_BLOCK_MAX_BYTES = 8192


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
    kept: tuple[Kept, ...] = ()  # detected spans left in place (static/protected), for /admin/explain only
    lora: str | None = None  # the LoRA adapter that went into the seed, if any
    # The chain continued past the window (text chunks, or token-id chunks) and, per key, the
    # prompt tokens up to its end (estimated from characters for text).
    text_keys: tuple[int, ...] = ()
    text_key_tokens: tuple[int, ...] = ()
    # per text key its chunk's prints, where a precise replica can use them (PrefixPipeline.fork_gate)
    text_forks: TextForks | None = None
    # what the tokens are counted in: "exact (llama3)", "approximate (llama3): block size 16 vs engine 128"
    units: str | None = None
    tokens_exact: bool = False  # the window is counted in the served model's own tokenizer and template
    base_model: str | None = None  # the model that went into the seed (the adapter's base for a LoRA)

    @property
    def keys(self) -> tuple[int, ...]:
        """The whole chain: token blocks of the window, then the continuation keys."""
        return self.block_keys + self.text_keys if self.text_keys else self.block_keys


class PrefixPipeline:
    """Normalize → tokenize (bounded window) → hash, for one route's settings."""

    def __init__(
        self,
        normalize: NormalizeSettings,
        prefix: PrefixSettings,
        identities: ModelIdentities | None = None,
        *,
        normalizer: Normalizer | None = None,
        tokens: ModelWindows | None = None,
        anchors: PromptAnchors | None = None,
    ) -> None:
        """``identities``: the gateway's LoRA adapter table, shared by every route's pipeline;
        ``normalizer``, ``tokens``, ``anchors``: parts of a pipeline with the same ``normalize``
        (resp. ``prefix``) settings to keep, with what they learned (see :meth:`reconfigured`)."""
        self.normalize_settings = normalize
        self.settings = prefix
        self.normalizer = normalizer if normalizer is not None else Normalizer(normalize)
        # the tokenizer + chat template per request model (tokenizer: auto | NAME | hf:DIR)
        if tokens is None:
            tokens = ModelWindows(prefix.tokenizer, prefix.window_tokens, prefix.token_cache_tokens)
        self.tokens = tokens
        # exact prompt lengths from replies, by the prompt's last text key (see gateway.prefix.anchors)
        self.anchors = anchors if anchors is not None else PromptAnchors(prefix.prompt_anchors)

        # which names are LoRA adapters of which base model (learned from the replicas' /v1/models)
        self.identities = identities if identities is not None else ModelIdentities()
        # the block size hashed with: the setting, or (auto) the replicas' own (follow_engines)
        self.block = choose(prefix.block_size, {})
        # (engine view version, replica list) when the block choice was last re-read (Route.follow_engines)
        self.engine_stamp: tuple[int, object] | None = None
        # whether text chunks get fork prints now (set by Route.attach_precise: while a replica
        # publishes KV events; None: never, they cost ~1 µs per KB and only precise matching reads them)
        self.fork_gate: Callable[[], bool] | None = None

    def reconfigured(self, normalize: NormalizeSettings, prefix: PrefixSettings) -> PrefixPipeline:
        """The pipeline for a reloaded route with these settings, keeping what is still valid.

        Both unchanged: this pipeline itself.  Else a new one that keeps the normalizer — the
        places learned to vary, the discovered rules — while ``normalize`` is unchanged (what
        the detectors, rules and learning limits found does not depend on the tokenizer), and
        the tokenizers with their segment token cache while ``prefix`` is unchanged (a
        segment's tokens do not depend on normalization).  What a reload resets is written
        in docs/fleet.md ("What a reload applies").
        """
        same_normalize, same_prefix = normalize == self.normalize_settings, prefix == self.settings
        if same_normalize and same_prefix:
            return self
        pipeline = PrefixPipeline(
            normalize,
            prefix,
            self.identities,
            normalizer=self.normalizer if same_normalize else None,
            tokens=self.tokens if same_prefix else None,
            anchors=self.anchors if same_prefix else None,
        )
        if same_prefix:  # the engines' block size still holds: no flip to 16 until the next re-read
            pipeline.block = self.block
        return pipeline

    @property
    def block(self) -> BlockSizeChoice:
        """The block size choice hashed with now."""
        return self._block

    @block.setter
    def block(self, choice: BlockSizeChoice) -> None:
        self._block = choice
        # whether some replica's engine uses another size, kept: asked per request
        # (Plan.predicted_units), and the choice names every replica
        self.block_mismatched = bool(choice.mismatched)
        # (alignment key, the engine's block size or None: the route's) -> units label under it
        self._labels: dict[tuple[str, int | None], str] = {}

    @property
    def block_size(self) -> int:
        """Tokens per hashed block right now."""
        return self.block.size

    def follow_engines(self, engines: Mapping[str, int]) -> BlockSizeChoice:
        """Re-choose the block size from each replica's scraped ``block_size`` (``auto``; see
        :mod:`gateway.prefix.block_size`).  Keys hashed at another size never match the new
        ones, so a change simply starts the route's key space afresh: nothing learned at the
        old size is mistaken for a hit."""
        choice = choose(self.settings.block_size, engines)
        if choice != self.block:
            if choice.size != self.block.size:
                log.info(
                    "prefix block size %d -> %d (%s: %s)",
                    self.block.size,
                    choice.size,
                    choice.source,
                    ", ".join(f"{name}={size}" for name, size in sorted(engines.items())) or "no engine known",
                )
            self.block = choice
        return choice

    def share_view(self, other: PrefixPipeline) -> None:
        """Take ``other``'s engine view (block size choice, LoRA adapters): a shadow pipeline
        (the sample buffer's relocating twin) must key as the route it shadows."""
        self.identities = other.identities
        if self.block != other.block:
            self.block = other.block

    def identity(self, model: str, salt: object = None) -> tuple[str, str | None, int]:
        """(base model, LoRA adapter or None, first-block seed) of a request, as the engine keys it."""
        if self.settings.lora_from_model:  # the route's fixed rule (before adapters were learned)
            base, lora = self.settings.base_model or model, model
        else:
            base, lora = self.identities.resolve(model)
        return base, lora, engine_seed(base, lora, salt if isinstance(salt, str) and salt else None)

    def units(self, model: str) -> tuple[str, bool]:
        """The units label of a (base) model's predictions and whether its tokens are the model's own."""
        alignment = self.tokens.for_model(model).alignment  # type: ignore[attr-defined]
        return self._label(alignment, None), alignment.exact

    def units_on(self, model: str, engine_block_size: int | None) -> str:
        """The units label of a prediction for a replica whose engine uses ``engine_block_size``
        (None: not scraped yet): where the route's replicas disagree on the block size, the
        replicas at the route's own size are not the ones whose blocks the keys miss, so only the
        others are labelled with the mismatch (:meth:`units` is the route's label: every
        mismatch named)."""
        if not self.block_mismatched or not engine_block_size:
            return self.units(model)[0]
        return self._label(self.tokens.for_model(model).alignment, engine_block_size)  # type: ignore[attr-defined]

    def _label(self, alignment: Alignment, engine_block_size: int | None) -> str:
        """:func:`units_label` under the current choice, as the route sees its engines (None) or
        as one engine using ``engine_block_size`` does; cached until the choice changes."""
        key = (alignment.key, engine_block_size)
        label = self._labels.get(key)
        if label is None:
            block = self.block
            if engine_block_size is not None:
                block = replace(block, engines={"engine": engine_block_size})
            label = self._labels[key] = units_label(alignment, block)
        return label

    def warm(self, models: Iterable[str]) -> None:
        """Load each model's vocabulary and chat template now, not on its first request.

        Loading a BPE vocabulary takes ~0.4 s: paid at startup (before ``/ready``), the first
        user request does not wait for it.  A dry-run prepare: nothing is learned or recorded.
        """
        for model in models:
            self.prepare("chat", {"model": model, "messages": [{"role": "user", "content": "warm up"}]}, learn=False)

    def prepare(self, endpoint: str, body: dict[str, Any], *, learn: bool = True) -> PreparedPrompt:
        """``endpoint`` is "chat" or "completions"; other endpoints get no keys.

        ``learn=False`` for dry runs (explain): normalization decides but records nothing.
        """
        return self.key(endpoint, self.normalize(endpoint, body, learn=learn))

    def normalize(self, endpoint: str, body: dict[str, Any], *, learn: bool = True) -> NormalizeResult:
        """The first stage (timed on its own by ``benchmarks/bench_prefix_path.py``)."""
        try:
            return self.normalizer.apply(endpoint, body, learn=learn)
        except (RecursionError, ValueError, TypeError, AttributeError):
            # Normalization is an optimization: a body it cannot walk (e.g. tools nested
            # thousands deep) is forwarded and keyed as the client sent it.
            return NormalizeResult(body)

    def key(self, endpoint: str, result: NormalizeResult) -> PreparedPrompt:
        """Tokenize the window, hash it, and continue the chain over the rest of the text."""
        body = result.body
        base, lora, seed = self.identity(str(body.get("model", "")), body.get("cache_salt"))
        try:
            tokens, bytes_per_token = self._window(endpoint, body, base)
            window_ok = True
        except (RecursionError, ValueError, TypeError, AttributeError, OverflowError, MemoryError):
            # Content the template cannot render (deep nesting, odd types): key the text only.
            tokens, bytes_per_token, window_ok = array("I"), None, False
        block_size = self.block.size
        keys = chain_block_keys(tokens, block_size, seed)
        text_keys: list[int] = []
        text_tokens: list[int] = []
        forks: TextForks | None = None
        if not window_ok or len(tokens) >= self.tokens.window:
            parent = keys[-1] if keys else seed
            keyed = len(keys) * block_size  # ids continue right after the last full block
            text_keys, text_tokens, estimate, forks = self._continue(
                endpoint, body, parent, len(tokens), keyed, bytes_per_token, base
            )
        else:
            estimate = self._estimate_total(endpoint, body, len(tokens))
        units, tokens_exact = self.units(base)
        return PreparedPrompt(
            body=body,
            block_keys=tuple(keys),
            block_size=block_size,
            window_tokens=len(tokens),
            prompt_tokens_estimate=estimate,
            normalized=result.counts,
            relocated=result.rewritten,
            spans_moved=len(result.changes),
            canonicalized=result.canonicalized,
            changes=result.changes,
            kept=result.kept,
            lora=lora,
            text_keys=tuple(text_keys),
            text_key_tokens=tuple(text_tokens),
            text_forks=forks,
            units=units,
            tokens_exact=tokens_exact,
            base_model=base,
        )

    def _continue(
        self,
        endpoint: str,
        body: dict[str, Any],
        parent: int,
        window: int,
        keyed: int,
        bytes_per_token: float | None = None,
        model: str = "",
    ) -> tuple[list[int], list[int], int, TextForks | None]:
        """Keys past the window, their token estimates, the whole prompt's estimate, and the
        chunks' fork prints (while :attr:`fork_gate` says a precise replica can use them).

        Text is read without the chat template (the template decides token boundaries, not
        where two prompts differ): per message its role, name, text content, non-text parts'
        URLs and tool calls, each message its own run of chunks.  Chunks ending within the
        first ``window`` bytes are not keyed (at least one byte per token: the window's
        ``window`` tokens cover them).  Token estimates count ``bytes_per_token`` — the
        window's own ratio, measured as it was tokenized (:meth:`WindowTokenizer.measured`) —
        or ~4 without one, and exact at keys where earlier replies measured the prompt
        (:class:`~gateway.prefix.anchors.PromptAnchors`): a key's is its end, never less than
        the window, never more than the prompt's; the prompt's is all the text read.
        """
        if endpoint == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
                prompt = prompt[0]
            if isinstance(prompt, list):  # token ids: exact continuation
                keys = chain_id_keys(prompt[keyed:], parent, _ID_CHUNK)
                tokens = [min(len(prompt), keyed + (i + 1) * _ID_CHUNK) for i in range(len(keys))]
                return keys, tokens, max(window, len(prompt)), None
            messages: list[Sequence[str]] = [(prompt,)] if isinstance(prompt, str) else []
        else:
            messages = _message_texts(body.get("messages"), body.get("tools"))
        gate = self.fork_gate
        print_bytes = self.settings.print_bytes if gate is not None and gate() else 0
        keys, ends, prints, first_start = chain_text_keys(
            messages,
            parent,
            self.settings.chunk_bytes,
            skip_bytes=window,
            print_bytes=print_bytes,
            print_tail=self.settings.fork_tail_bytes,
        )
        measured = _clamp_bytes_per_token(bytes_per_token)
        per_token = measured or _CHARS_PER_TOKEN
        if ends and measured is not None:  # the whole text read, at the window's own ratio
            estimate = max(window, int(ends[-1] / per_token))
        else:  # content characters at ~4 per token; the text read if the window could not be rendered
            estimate = self._estimate_total(endpoint, body, window)
            if ends and not estimate:
                estimate = max(window, int(ends[-1] / per_token))
        # Each key's estimate is its end, never less than the window nor more than the prompt
        # (the estimate is never under the window); ends grow, so only the last few can need
        # clamping down.
        tokens = [max(window, int(end / per_token)) for end in ends]
        if ends and endpoint == "chat":
            estimate += self._count_values_block(messages, ends, tokens, per_token, model)
        anchored = self.anchors.estimate(keys, ends, tokens, window)  # exact where replies measured the text
        if anchored is not None:
            estimate = max(window, anchored)
        last = len(tokens) - 1
        while last >= 0 and tokens[last] > estimate:
            tokens[last] = estimate
            last -= 1
        forks = None
        if print_bytes and keys:
            # the first chunk's start, counted back from its (corrected) end at the window's ratio
            start = max(0, tokens[0] - int((ends[0] - first_start) / per_token))
            forks = TextForks(tuple(prints), tuple(ends), print_bytes, (first_start, start))
        return keys, tokens, estimate, forks

    def _count_values_block(
        self, messages: Sequence[Sequence[str]], ends: Sequence[int], tokens: list[int], per_token: float, model: str
    ) -> int:
        """Count our values block (relocation's, at the end of the prompt) in tokens, not bytes.

        Its ids and timestamps tokenize ~2.5 times denser than prose, and it sits at the prompt's
        end: estimated at the window's ratio it under-counts the prompt's last tokens, and a
        reply's exact count carried back across it (the anchors) over-counts everything
        before — the depth the next turn shares (measured: benchmarks/README.md, "Forks
        inside a chunk").  It is short, so it is tokenized; the keys past its start get the
        difference (in place), which is returned for the prompt's estimate."""
        later: list[str] = []  # the messages after the one searched
        for i in range(len(messages) - 1, max(-1, len(messages) - 1 - _BLOCK_SEARCH), -1):
            text = "\x1f".join(messages[i])
            tail = max(0, len(text) - _BLOCK_MAX_BYTES - len(BLOCK_OPEN))  # appended: only its end is read
            end_text = text[tail:]
            spans = our_blocks(end_text) if BLOCK_OPEN in end_text else []
            if not spans:
                later.append(text)
                continue
            start, end = (tail + at for at in spans[-1])
            size = len(text[start:end].encode("utf-8", "surrogatepass"))
            after = len(text[start:].encode("utf-8", "surrogatepass"))
            after += sum(len(MESSAGE_MARK) + len(t.encode("utf-8", "surrogatepass")) for t in later)
            begin = ends[-1] - after
            if begin < 0 or not 0 < size <= _BLOCK_MAX_BYTES:
                return 0
            delta = len(self.tokens.for_model(model).tokenizer.encode(text[start:end])) - int(size / per_token)
            for j in range(len(ends) - 1, -1, -1):
                if ends[j] <= begin:
                    break
                tokens[j] += delta * min(size, ends[j] - begin) // size
            return delta
        return 0

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

    def window_tokens(self, endpoint: str, body: dict[str, Any]) -> array[int]:
        """The token ids of ``body``'s leading window as :meth:`prepare` hashes them (no normalization).

        For observers that re-key an already prepared body another way (the sample buffer
        hashes it once more without the tenant salt).
        """
        return self._window(endpoint, body, self.identity(str(body.get("model", "")))[0])[0]

    def _window(self, endpoint: str, body: dict[str, Any], model: str) -> tuple[array[int], float | None]:
        """The leading window's token ids and the bytes per token of its text (None: no text).

        ``model`` is the base model: a LoRA adapter tokenizes with its base model's vocabulary."""
        tokens = self.tokens.for_model(model)
        if endpoint == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list):
                return array("I"), None
            return tokens.chat_measured(messages, body.get("tools"))
        if endpoint == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
                prompt = prompt[0]  # a batch of prompts: key on the first one
            if isinstance(prompt, str):
                return tokens.text_measured(prompt)
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt[: tokens.window]):
                try:
                    return tokens.ids(prompt), None
                except OverflowError:  # ids outside u32: no keys rather than an error here
                    return array("I"), None
        return array("I"), None


def _message_texts(messages: Any, tools: Any) -> list[Sequence[str]]:
    """The text of each chat message (and of the tool definitions) as pieces, for hashing.

    Reads only strings at known places, one level of content parts deep, so no input can
    make it recurse or raise; what it cannot read it leaves out.
    """
    out: list[Sequence[str]] = []
    if tools:
        try:
            out.append(("tools", json.dumps(tools, separators=(",", ":"), ensure_ascii=False)))
        except (TypeError, ValueError, RecursionError):
            out.append(("tools",))
    if not isinstance(messages, list):
        return out
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        pieces: list[str] = [role if isinstance(role, str) else ""]
        name = message.get("name")
        if isinstance(name, str):
            pieces.append(name)
        content = message.get("content")
        if isinstance(content, str):
            pieces.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, str):
                    pieces.append(part)
                elif isinstance(part, dict):
                    pieces.append(_part_text(part))
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    pieces.extend(v for v in (function.get("name"), function.get("arguments")) if isinstance(v, str))
        call_id = message.get("tool_call_id")
        if isinstance(call_id, str):
            pieces.append(call_id)
        out.append(pieces)
    return out


def _part_text(part: dict[str, Any]) -> str:
    """A content part's text, or a non-text part's type and URL/data (when they are strings)."""
    kind = part.get("type", "text")
    text = part.get("text")
    if kind == "text" and isinstance(text, str):
        return text
    payload = part.get(kind) if isinstance(kind, str) else None
    if isinstance(payload, dict):
        payload = payload.get("url") or payload.get("data")
    return f"<{kind}>{payload}" if isinstance(payload, str) and isinstance(kind, str) else f"<{type(kind).__name__}>"
