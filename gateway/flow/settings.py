"""The ``flow_control:`` config section: when a route counts as saturated, how requests wait.

Top level (one section for every route), with the few per-route knobs — the default
priority and whether the priority is forwarded as vLLM's ``X-Vllm-Priority`` — in
:class:`RouteFlowSettings` under each route's ``flow_control:``.

Priorities follow the Kubernetes inference gateway (llm-d): a larger number is more
important, 0 is the default, a negative priority is *sheddable* (answered 429 at once while
the route is saturated instead of queued).  vLLM's priority scheduler runs the *lowest*
value first, so the value forwarded is the negation (``X-Vllm-Priority: -priority``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

#: where a request's objective (its priority's name) is read, preferred first
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
#: where a request's flow (its fairness id) is read, preferred first
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")


class _Strict(BaseModel):
    model_config = {"extra": "forbid"}


class SaturationSettings(_Strict):
    """Per-replica limits: a replica at or over any of them has no room; a route whose every
    eligible replica has no room is saturated.  0 turns a limit off."""

    queued_prefill_tokens: int = Field(
        16384,
        ge=0,
        description="uncached prompt tokens sent to a replica with no first byte yet (ours and the peers'), "
        "behind the prefill its engine is computing",
    )
    in_flight: int = Field(0, ge=0, description="requests in flight on a replica (ours and the peers'; 0 = off)")
    waiting: float = Field(
        8,
        ge=0,
        description="the engine's vllm:num_requests_waiting as last scraped, less the answers seen since (0 = off)",
    )
    running: float = Field(0, ge=0, description="the engine's vllm:num_requests_running as last scraped (0 = off)")
    kv_cache_usage: float = Field(
        0.98, ge=0, le=1, description="the engine's vllm:kv_cache_usage_perc (0..1) as last scraped (0 = off)"
    )
    scrape_stale_s: float = Field(
        30.0,
        ge=0,
        description="a replica scraped longer ago than this has no room (its numbers cannot be trusted) while "
        "another replica of its route has fresh numbers; with none fresh, all are judged on the gateway's own "
        "counts (0 = off)",
    )


class BandSettings(_Strict):
    """One priority band's own bounds (unset: the section's defaults)."""

    max_requests: int | None = Field(None, ge=0, description="requests queued in the band at most")
    max_bytes: int | None = Field(None, ge=0, description="request bodies queued in the band, bytes at most")
    ttl_s: float | None = Field(None, gt=0, description="how long a request of the band waits at most")


class FlowControlSettings(_Strict):
    """Hold requests at the gateway while a route is saturated; dispatch by priority and fairness."""

    # On by default (issue 26's rule: off only if it costs anything at moderate load): on the policy
    # benchmark, median of 3, every moderate cell's TTFT p50/p90 and hit rate equal the route
    # without it (nothing saturates), and at saturation TTFT p90 is 0.94-1.04x with hits equal or
    # higher (see docs/flow-control.md "Status").
    enabled: bool = Field(True, description="queue while saturated (off: every request is placed at once)")
    saturation: SaturationSettings = Field(
        default_factory=SaturationSettings, description="when a replica has no room (and a route is saturated)"
    )
    max_requests_per_band: int = Field(4096, ge=0, description="requests queued per priority band, per route")
    max_bytes_per_band: int = Field(
        256 * 1024 * 1024, ge=0, description="request bodies queued per priority band, per route (bytes)"
    )
    ttl_s: float = Field(30.0, gt=0, description="how long a queued request waits at most (then expired_status)")
    expired_status: Literal[429, 503] = Field(
        503, description="the status a request whose TTL ran out gets (with retry-after)"
    )
    retry_after_s: float = Field(1.0, gt=0, description="the retry-after sent with a shed, refused or expired request")
    bands: dict[int, BandSettings] = Field(
        default_factory=dict, description="per-priority overrides of the queue bounds and TTL"
    )
    objectives: dict[str, int] = Field(
        default_factory=dict,
        description="objective name (the x-llm-d-inference-objective header) -> priority (larger first, <0 sheddable)",
    )
    objective_headers: list[str] = Field(
        default_factory=lambda: list(OBJECTIVE_HEADERS), description="headers naming a request's objective, first wins"
    )
    fairness_headers: list[str] = Field(
        default_factory=lambda: list(FAIRNESS_HEADERS),
        description="headers naming a request's flow (else its API key, else its route), first wins",
    )
    api_key_priorities: dict[str, int] = Field(
        default_factory=dict,
        description="sha256 hex of a client API key (see auth:) -> its requests' default priority",
    )
    fairness_quantum_tokens: int = Field(
        1024, ge=1, description="cost of a request whose prompt length is unknown, in prompt tokens (fair sharing)"
    )
    # 5 s: with look-past the others pass a waiting head, so the wait costs the head alone; on the
    # policy benchmark at saturation 0 lost up to 13.8 hit-rate points (the head spilled to whichever
    # replica freed first), 2, 5 and 30 s gave the same hits within 0.4 points (benchmarks/README.md)
    affinity_wait_s: float = Field(
        5.0,
        ge=0,
        description="how long the head of the queue may wait for its prefix's replica while another has room "
        "(from the first time it was held back so)",
    )
    lookahead: int = Field(
        16,
        ge=1,
        le=256,
        description="queued entries (fair order, any flow) the dispatcher looks at for one whose own decision "
        "has room (1: the head only)",
    )
    flow_label_limit: int = Field(
        16, ge=0, le=1000, description="flows named in metrics per route (the busiest; the rest are 'other')"
    )

    @field_validator("objective_headers", "fairness_headers")
    @classmethod
    def _lower(cls, values: list[str]) -> list[str]:
        return [v.strip().lower() for v in values if v.strip()]

    @field_validator("api_key_priorities")
    @classmethod
    def _hex_keys(cls, values: dict[str, int]) -> dict[str, int]:
        for key in values:
            if len(key) != 64 or any(c not in "0123456789abcdef" for c in key.lower()):
                raise ValueError("api_key_priorities: each key is the sha256 hex (64 characters) of a client key")
        return {k.lower(): v for k, v in values.items()}

    def band(self, priority: int) -> tuple[int, int, float]:
        """(max requests, max bytes, ttl) of ``priority``'s band."""
        own = self.bands.get(priority)
        if own is None:
            return self.max_requests_per_band, self.max_bytes_per_band, self.ttl_s
        return (
            self.max_requests_per_band if own.max_requests is None else own.max_requests,
            self.max_bytes_per_band if own.max_bytes is None else own.max_bytes,
            self.ttl_s if own.ttl_s is None else own.ttl_s,
        )


class RouteFlowSettings(_Strict):
    """A route's own flow-control knobs (under the route's ``flow_control:``)."""

    default_priority: int | None = Field(
        None, description="priority of requests naming no objective and sent with no prioritized key (None: 0)"
    )
    forward_priority: bool = Field(
        False,
        description="send X-Vllm-Priority (the negated priority: vLLM runs lower first) to replicas started "
        "with --scheduling-policy priority",
    )
