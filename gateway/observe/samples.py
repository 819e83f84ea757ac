"""A bounded, redacted buffer of recent request *shapes*: what ``GET /admin/samples`` returns.

``prefix-gateway doctor`` needs to see the traffic to say why the hit rate is low, but the
gateway must not keep prompt text.  So each sample keeps only the request's shape — roles,
lengths, fingerprints of each message and tool, a fingerprint of the tenant salt — and two
chains of block keys:

- ``keys``: the chain the route hashed, *without* the tenant salt (so doctor can replay the
  traffic with and without salts: a salt changes every key, which is the same as giving each
  salt its own namespace);
- ``keys_relocated``: the chain the request would have had with every detected volatile span
  relocated (computed by a shadow pipeline in ``relocate`` mode), or ``None`` when the route
  already relocates.

Replaying both chains through an LRU cache of blocks gives the hit rate now and the hit rate
with relocation, without any text.  Fingerprints and keys are re-hashed with a secret drawn
when the process starts, so they can be compared within one buffer but cannot be matched
against guessed prompts.  ``samples.include_text`` (a DEBUG setting) keeps the body as well,
so doctor can test rules no detector knows.

Bounded by count and by bytes (the JSON size of each sample); the oldest go first.  Off by
default: the shadow chain costs a second normalize + tokenize + hash per request.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from gateway.config import SampleSettings
from gateway.prefix.blocks import chain_block_keys
from gateway.prefix.pipeline import PrefixPipeline

if TYPE_CHECKING:
    from gateway.observe.outcome import Outcome
    from gateway.routing.plan import Plan
    from gateway.routing.routes import Route

log = logging.getLogger("prefix_gateway.samples")

_SHADOW_TOKEN_CACHE = 200_000  # tokens: the shadow pipeline's own small segment cache


class Fingerprinter:
    """Keyed 32-bit fingerprints: equal inputs match within a process, guesses cannot be checked."""

    def __init__(self, secret: int | None = None) -> None:
        self.seed = secret if secret is not None else int.from_bytes(os.urandom(8), "little")

    def text(self, value: str) -> str:
        return f"{xxhash.xxh3_64_intdigest(value.encode('utf-8', 'surrogatepass'), seed=self.seed) & 0xFFFFFFFF:08x}"

    def key(self, value: int) -> str:
        return f"{xxhash.xxh3_64_intdigest(value.to_bytes(8, 'little'), seed=self.seed) & 0xFFFFFFFF:08x}"


def _content_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def body_parts(endpoint: str, body: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(where, role, text) of every part of a request that reaches the prompt, in template order.

    Tools come first because the chat template renders them before the messages.
    """
    parts: list[tuple[str, str, str]] = []
    if endpoint == "chat":
        tools = body.get("tools")
        if isinstance(tools, list):
            for i, tool in enumerate(tools):
                parts.append((f"tools[{i}]", "tool_definition", _content_text(tool)))
        messages = body.get("messages")
        if isinstance(messages, list):
            for i, message in enumerate(messages):
                if isinstance(message, Mapping):
                    role = message.get("role")
                    text = _content_text(message.get("content"))
                    parts.append((f"messages[{i}]", role if isinstance(role, str) else "?", text))
    elif endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        parts.append(("prompt", "prompt", _content_text(prompt)))
    return parts


def salt_of(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


def unsalted_keys(pipeline: PrefixPipeline, endpoint: str, body: Mapping[str, Any]) -> list[int]:
    """The chain ``pipeline`` hashes for an already normalized ``body``, seeded without a salt."""
    tokens = pipeline.window_tokens(endpoint, dict(body))
    _base, _lora, seed = pipeline.identity(str(body.get("model", "")), None)
    return chain_block_keys(tokens, pipeline.block_size, seed)


class SampleBuffer:
    """Recent request shapes, bounded by count and bytes.  Lives on the event loop: no locks."""

    def __init__(
        self, settings: SampleSettings, routes: Callable[[], Sequence[Route]], secret: int | None = None
    ) -> None:
        self.settings = settings
        self.fp = Fingerprinter(secret)
        self._samples: deque[tuple[int, dict[str, Any]]] = deque()
        self.bytes = 0
        self.dropped = 0
        self.recorded = 0
        self._routes = routes  # read on each snapshot: a config reload swaps routes
        # route name -> (the normalize/prefix settings it was built from, the shadow pipeline)
        self._shadows: dict[str, tuple[object, PrefixPipeline | None]] = {}

    # -- recording --------------------------------------------------------------------
    def record(self, plan: Plan, body: Mapping[str, Any], outcome: Outcome) -> None:
        """Add the shape of one finished request.  Never raises: a sample is never worth a failed request."""
        try:
            sample = self.shape(plan, body, outcome)
        except Exception:  # never log the body: it may hold prompt text
            log.exception("could not record a request sample (route %s)", plan.route.name)
            return
        self.add(sample)

    def add(self, sample: dict[str, Any]) -> None:
        size = len(json.dumps(sample, separators=(",", ":"), ensure_ascii=False).encode())
        self._samples.append((size, sample))
        self.bytes += size
        self.recorded += 1
        while self._samples and (len(self._samples) > self.settings.max_count or self.bytes > self.settings.max_bytes):
            old, _ = self._samples.popleft()
            self.bytes -= old
            self.dropped += 1

    def shape(self, plan: Plan, body: Mapping[str, Any], outcome: Outcome) -> dict[str, Any]:
        route, endpoint, prepared = plan.route, plan.endpoint, plan.prepared
        fp = self.fp
        salt = salt_of(body)
        sample: dict[str, Any] = {
            "t": round(time.time(), 3),
            "route": route.name,
            "endpoint": endpoint,
            "model": plan.request.model,
            "salt": None if salt is None else fp.text(salt),
            "parts": [
                {"where": where, "role": role, "chars": len(text), "fp": fp.text(text)}
                for where, role, text in body_parts(endpoint, body)
            ],
            "replica": outcome.replica,
            "reason": outcome.reason,
            "status": outcome.status,
            "prompt_tokens": outcome.prompt_tokens,
            "cached_tokens": outcome.cached_tokens,
            "predicted_cached_tokens": outcome.predicted_cached_tokens,
            "normalized": dict(prepared.normalized) if prepared is not None else {},
            "block_size": prepared.block_size if prepared is not None else None,
            "window_tokens": prepared.window_tokens if prepared is not None else None,
            "keys": None,
            "keys_relocated": None,
            "tokens_relocated": None,  # prompt tokens with relocation (exact within the window, else estimated)
            "spans": [],  # [where, rule] of each detected volatile span (never its value)
        }
        pipeline = route.pipeline
        if prepared is not None and pipeline is not None:
            sample["keys"] = [fp.key(k) for k in unsalted_keys(pipeline, endpoint, prepared.body)]
            changes = prepared.changes
            shadow = self._shadow(route)
            if shadow is not None:
                shadow.share_view(pipeline)  # the same block size and adapters as the route's own
                unsalted = {k: v for k, v in body.items() if k != "cache_salt"}
                relocated = shadow.prepare(endpoint, unsalted)
                sample["keys_relocated"] = [fp.key(k) for k in relocated.block_keys]
                sample["tokens_relocated"] = relocated.prompt_tokens_estimate
                changes = relocated.changes
            sample["spans"] = sorted({(c.where, c.rule) for c in changes})
        if self.settings.include_text:
            sample["body"] = dict(body)
        return sample

    def _shadow(self, route: Route) -> PrefixPipeline | None:
        """The route's pipeline in ``relocate`` mode (None when the route already relocates).

        Rebuilt when a reload gave the route other normalize or prefix settings.
        """
        built = (route.config.normalize, route.config.prefix)
        cached = self._shadows.get(route.name)
        if cached is not None and cached[0] == built:
            return cached[1]
        normalize, prefix = built
        shadow = None
        if normalize.mode != "relocate":
            cache = min(prefix.token_cache_tokens, _SHADOW_TOKEN_CACHE)
            prefix = prefix.model_copy(update={"token_cache_tokens": cache})
            shadow = PrefixPipeline(normalize.model_copy(update={"mode": "relocate"}), prefix)
        self._shadows[route.name] = (built, shadow)
        return shadow

    # -- reading ----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """``GET /admin/samples``: the settings, each route's keying, and the samples (oldest first)."""
        routes = {}
        for route in self._routes():
            config = route.config
            routes[route.name] = {
                "policy": route.policy,
                "normalize": config.normalize.mode,
                "block_size": route.pipeline.block_size if route.pipeline is not None else None,
                "block_size_setting": config.prefix.block_size,
                "tokenizer": config.prefix.tokenizer,
                "window_tokens": config.prefix.window_tokens,
                "replicas": [r.name for r in route.runner.replicas],
            }
        return {
            "enabled": True,
            "include_text": self.settings.include_text,
            "max_count": self.settings.max_count,
            "max_bytes": self.settings.max_bytes,
            "count": len(self._samples),
            "bytes": self.bytes,
            "recorded": self.recorded,
            "dropped": self.dropped,
            "routes": routes,
            "samples": [sample for _, sample in self._samples],
        }
