"""The state of one simulated replica and the HTTP-free steps every request shares.

Model resolution, prompt limits and turning token ids into engine requests live here so
the endpoint modules only parse, call, and render.
"""

from __future__ import annotations

import itertools
import os
import time

from gateway.sim import SIM_VERSION
from gateway.sim.engine import Engine, EngineRequest
from gateway.sim.faults import FaultState
from gateway.sim.hashing import block_hashes, block_seed
from gateway.sim.kvpublisher import ZmqKVPublisher
from gateway.sim.metrics import SimMetrics
from gateway.sim.options import SimOptions
from gateway.sim.protocol import APIError
from gateway.sim.textgen import TextGenerator
from gateway.sim.tokencache import CachingTokenizer
from gateway.sim.tokenizer import PromptBuilder, SimTokenizer


class Replica:
    """Everything one replica owns: tokenizer, engine + KV cache, metrics, faults."""

    def __init__(self, options: SimOptions) -> None:
        self.options = options
        # the replica's own tokenizer and chat rendering (never the gateway's: see sim/tokenizer.py)
        self.tokenizer = CachingTokenizer(SimTokenizer(options.tokenizer))
        self.prompts = PromptBuilder(self.tokenizer.inner, self.tokenizer.encode)
        self.metrics = SimMetrics(options)
        self.engine = Engine(options, self.metrics)
        self.textgen = TextGenerator(self.tokenizer, options.seed, options.retokenize_drift)
        self.faults = FaultState(options.faults(), options.seed)
        self.max_model_len = options.effective_max_model_len
        self.block_size = options.block_size
        self.created = int(time.time())
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(6).hex()
        self._loras = frozenset(options.lora_modules)
        self.fingerprint = "vllm-" + SIM_VERSION  # vLLM's system_fingerprint: its version
        # the ZMQ side of the KV events, when --kv-events-config publishes (set by the app)
        self.kv_publisher: ZmqKVPublisher | None = None

    def reset_metrics(self) -> None:
        """Fresh counters, as after a process restart (scrapers then see a counter reset);
        ``/sim/state``'s totals start over too, so they keep matching ``/metrics``."""
        self.metrics = SimMetrics(self.options)
        self.engine.metrics = self.metrics
        self.engine.total_queries = self.engine.total_hits = 0

    def new_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):020x}"

    def resolve_model(self, requested: str | None) -> tuple[str, str | None]:
        """(served name, LoRA name or None); unknown names are vLLM's 404."""
        if requested is None or requested == self.options.model:
            return self.options.model, None
        if requested in self._loras:
            return requested, requested
        raise APIError(
            404, f"The model `{requested}` does not exist. Valid aliases: {self.options.model}.", param="model"
        )

    def block_seed(self, lora: str | None, cache_salt: str | None) -> int:
        """The first block's seed: model, LoRA and ``cache_salt`` (validated with the request)."""
        return block_seed(self.options.model, lora, cache_salt)

    def check_prompt_len(self, num_tokens: int, what: str = "messages", text: bool = True) -> None:
        """vLLM 0.32's prompt limit: a prompt longer than ``max_model_len`` is refused (400).

        A prompt given as text is tokenized with truncation to ``max_model_len + 1`` tokens,
        so vLLM can only say "at least" that many; token ids are counted as they are.
        """
        limit = self.max_model_len
        if num_tokens <= limit:
            return
        count = min(num_tokens, limit + 1) if text else num_tokens
        qualifier = "at least " if count == limit + 1 else ""
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt contains "
            f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.",
            param="input_tokens",
            value=count,
        )

    def check_max_tokens(self, requested: int | None, param: str = "max_tokens") -> None:
        """vLLM 0.32 refuses ``max_tokens`` larger than ``max_model_len`` before tokenizing."""
        if requested is not None and requested > self.max_model_len:
            raise APIError(
                400,
                f"{param}={requested} cannot be greater than max_model_len={self.max_model_len}. "
                "Please request fewer output tokens.",
                param=param,
                value=requested,
            )

    def output_plan(
        self, num_prompt: int, requested: int | None, what: str = "messages", text: bool = True
    ) -> tuple[int, str]:
        """(output length, finish_reason) for a prompt, with vLLM 0.32's length rules.

        ``max_tokens`` is clamped to the room the prompt leaves (vLLM's ``get_max_tokens``:
        a prompt + ``max_tokens`` over ``max_model_len`` is served, its output cut short);
        the sequence then always runs to it (``finish_reason`` "length").  Without
        ``max_tokens`` the "model" stops by itself after ``--max-output-tokens`` ("stop").
        A length below 1 is returned as is: it fails in :func:`gateway.sim.sampling.check_sampling`,
        where vLLM refuses it.
        """
        self.check_prompt_len(num_tokens=num_prompt, what=what, text=text)
        room = self.max_model_len - num_prompt
        if requested is None:
            default = self.options.max_output_tokens
            if default <= room:
                return default, "stop"
            out = room
        else:
            out = min(requested, room)
        return out, "length"

    def lora_id(self, lora: str | None) -> int | None:
        """vLLM's integer adapter id (1, 2, ... in the order the LoRA modules were given)."""
        if lora is None:
            return None
        return self.options.lora_modules.index(lora) + 1

    def engine_requests(
        self,
        prompt: list[int],
        out_len: int,
        reason: str,
        n: int,
        seed: int,
        arrival: float,
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> list[EngineRequest]:
        """One engine request per choice; each carries its output tokens and block keys.

        ``lora`` and ``cache_salt`` only label the KV events (the isolation itself is in
        ``seed``, :meth:`block_seed`).
        """
        digest = self.textgen.prompt_digest(prompt)
        origin = (self.lora_id(lora) or 0, lora) if lora is not None else None
        out: list[EngineRequest] = []
        for choice in range(n):
            tokens = self.textgen.token_ids(digest, choice, out_len)
            computed = prompt + tokens[:-1]
            keys = block_hashes(computed, self.block_size, seed)
            out.append(EngineRequest(len(prompt), tokens, keys, reason, arrival, computed, origin, cache_salt))
        return out

    def run(self, reqs: list[EngineRequest]) -> None:
        """Start requests: synchronously at time_scale 0, else queue them in the engine."""
        engine = self.engine
        if engine.instant:
            for req in reqs:
                engine.run_instant(req)
        else:
            for req in reqs:
                engine.add_request(req)
