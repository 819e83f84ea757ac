"""The contract between the request path and routing policies.

A policy sees only plain, frozen data: one :class:`RequestView` built once per request
(after normalization, tokenization and hashing), and a :class:`ReplicaView` per *eligible*
replica (the runner has already removed unhealthy ones).  It returns a :class:`Decision`
that carries its reason; the caller turns reasons into metrics, logs and ``/admin/explain``.
Policies never touch HTTP clients, FastAPI, Prometheus or logs, and never block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import BaseModel

if TYPE_CHECKING:
    from gateway.prefix.blocks import TextForks


@dataclass(frozen=True, slots=True)
class RequestView:
    """Everything a policy may know about a request.  Add fields here, not methods."""

    request_id: str
    route: str
    model: str
    endpoint: str  # "chat" | "completions" | "embeddings"
    session_key: str | None = None  # value of the route's session header, if any
    # The whole prompt's key chain: ``token_blocks`` chained token-block hashes of the leading
    # window, then keys continuing the chain over the rest of the prompt (text chunks).
    block_keys: tuple[int, ...] = ()
    block_size: int = 0  # tokens per block in the token-block part of ``block_keys``
    prompt_tokens: int | None = None  # tokens in the (bounded) leading window
    prompt_tokens_estimate: int | None = None  # the whole prompt (estimated past the window)
    stream: bool = False
    token_blocks: int | None = None  # leading keys that are token blocks (None: all of them)
    key_tokens: tuple[int, ...] = ()  # per key past the token blocks: prompt tokens up to its end (estimated)
    key_forks: TextForks | None = None  # per key past the token blocks: its chunk's prints (where one can part)
    # The flow the client named (fairness header, else API key: gateway.flow.classify.named_flow);
    # None: anonymous, its route's one flow.  A head is not copied to spread one flow's own burst.
    flow: str | None = None
    # The served model's max_model_len (from the replicas' /v1/models; None: not known).  A prompt
    # estimated past it will be refused by the engine (400): the policy places it but records
    # nothing, since a record it later takes back would already have pushed others out.
    context_limit: int | None = None


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """A replica as a policy sees it at decision time."""

    name: str
    weight: float = 1.0
    in_flight: int = 0  # counted by the gateway itself, never only by a scrape
    kv_cache_usage: float | None = None  # scraped, may be stale or absent
    num_waiting: float | None = None  # scraped, may be stale or absent
    # Uncached prompt tokens of requests sent here that have not produced a first byte yet
    # (the prefill work queued ahead of a new request), counted by the gateway.
    pending_prefill_tokens: int = 0
    # The engine's prefix cache size in tokens (num_gpu_blocks x block_size from
    # vllm:cache_config_info), when a scrape has told it.
    kv_cache_tokens: int | None = None
    # The engine's own block size (vllm:cache_config_info), when a scrape has told it: a fleet
    # may disagree with the size its route hashes, and an engine caches whole blocks of its own.
    block_size: int | None = None
    # Of ``pending_prefill_tokens``, this gateway process's share per named flow (RequestView.flow):
    # how much of the wait ahead is the requesting flow's own work.
    pending_prefill_by_flow: Mapping[str, int] = field(default_factory=dict, compare=False)  # (views stay hashable)


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen replica and why.

    ``reason`` is a small fixed vocabulary per policy (bounded metric label), e.g.
    ``ring``, ``affinity``, ``spill``, ``fallback``, ``round_robin``.  ``detail`` is for
    ``/admin/explain`` only (never a metric label).
    """

    replica: str
    reason: str
    detail: Mapping[str, Any] = field(default_factory=dict)


class Policy(Protocol):
    """One routing policy.  Registered by name with a typed settings model."""

    name: ClassVar[str]

    def choose(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        """Pick one of ``replicas`` (never empty; all healthy)."""
        ...

    def peek(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        """What ``choose`` would answer now, changing nothing (``/admin/explain``'s dry run):
        the next real ``choose`` must behave exactly as if ``peek`` had never been called."""
        ...

    def set_members(self, members: Sequence[ReplicaView]) -> None:
        """The pool's full membership changed (see :class:`PolicyFactory`)."""
        ...

    def observe(self, request: RequestView, decision: Decision, cached_tokens: int | None) -> None:
        """Learn from a finished request (e.g. the prefix-affinity index).  May be a no-op."""
        ...


class PolicySettings(BaseModel):
    """Base class of every policy's settings model (unknown keys are errors)."""

    model_config = {"extra": "forbid"}


class PolicyFactory(Protocol):
    """How the runner builds a policy: its validated settings and the pool's full membership.

    ``members`` lists every configured replica (healthy or not, with weights) so that
    hash-based policies can keep a stable ring; ``choose`` then receives only the eligible
    subset.  ``set_members`` is called when membership changes (config reload, discovery).
    """

    def __call__(self, settings: Any, members: Sequence[ReplicaView]) -> Policy: ...
