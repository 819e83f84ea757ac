"""Benchmark workloads: deterministic request lists that the replayer sends open-loop.

Every workload is a plain list of :class:`BenchRequest` sorted by arrival time on the
*workload clock* (seconds since the workload starts).  The benchmark then compresses that
clock to reach a chosen offered load, so the same requests can be replayed at "moderate"
and "saturated" load and every policy sees byte-identical traffic.

Prompts are built once, up front, so the load generator does no per-request work beyond
sending pre-serialized bytes (the machine has 2 cores shared by the gateway and 4 sims).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Endpoint = Literal["chat", "completions"]
# the header a request's tenant travels in: flow control's fairness id (llm-d's name)
TENANT_HEADER = "x-llm-d-inference-fairness-id"


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload.

    ``body`` holds only the prompt part (``messages`` or ``prompt``); the replayer adds the
    model, ``max_tokens``, streaming and ``ignore_eos``.  ``prompt_tokens`` is the prompt
    length as the simulator will count it before any normalization (used to size load).
    """

    t: float
    endpoint: Endpoint
    body: dict[str, Any]
    max_tokens: int
    prompt_tokens: int
    session: str | None = None  # sent as the x-session-id header (the `session` policy's key)
    kind: str = "request"  # free-form label for analysis: turn, oneoff, unique, trace
    tenant: str | None = None  # sent as the fairness header (TENANT_HEADER): flow control's flow id


@dataclass(slots=True)
class Workload:
    """A named, seeded request list plus what the gateway route needs to serve it."""

    name: str
    description: str
    requests: list[BenchRequest]
    normalize: Literal["off", "report", "relocate"] = "off"
    meta: dict[str, Any] = field(default_factory=dict)
    # The same requests without what the workload exists to test (a volatile header): the pooled
    # oracle replays them too, giving the hit rate reachable had the application never added it.
    reference: list[BenchRequest] | None = None

    @property
    def duration(self) -> float:
        """Workload-clock span from the first to the last arrival (never 0)."""
        if not self.requests:
            return 1.0
        return max(self.requests[-1].t - self.requests[0].t, 1e-3)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def summary(self) -> dict[str, Any]:
        """Sizes worth printing and storing next to the results."""
        n = len(self.requests)
        prompt = [r.prompt_tokens for r in self.requests]
        return {
            "requests": n,
            "duration_s": round(self.duration, 3),
            "prompt_tokens_total": sum(prompt),
            "prompt_tokens_mean": round(sum(prompt) / n, 1) if n else 0,
            "prompt_tokens_max": max(prompt) if prompt else 0,
            "output_tokens_total": self.total_output_tokens,
            "sessions": len({r.session for r in self.requests if r.session}),
            "endpoint": self.requests[0].endpoint if self.requests else None,
            "normalize": self.normalize,
            **self.meta,
        }


WorkloadBuilder = Callable[..., Workload]


def builders() -> dict[str, WorkloadBuilder]:
    """Name -> builder(size: float, seed: int).  Imported lazily: the trace reader is heavy."""
    from benchmarks.workloads.agent import build_agent_workload
    from benchmarks.workloads.agent_tools import build_agent_long_workload, build_agent_toolloop_workload
    from benchmarks.workloads.control import build_control_workload
    from benchmarks.workloads.mooncake import build_mooncake_conversation, build_mooncake_synthetic
    from benchmarks.workloads.rag import build_rag_workload
    from benchmarks.workloads.tenants import build_tenants_workload

    return {
        "agent": build_agent_workload,
        "agent_long": build_agent_long_workload,
        "agent_toolloop": build_agent_toolloop_workload,
        "mooncake_conversation": build_mooncake_conversation,
        "mooncake_synthetic": build_mooncake_synthetic,
        "rag": build_rag_workload,
        "control": build_control_workload,
        "tenants": build_tenants_workload,
    }


WORKLOAD_NAMES = (
    "agent",
    "agent_long",
    "agent_toolloop",
    "mooncake_conversation",
    "mooncake_synthetic",
    "rag",
    "control",
    "tenants",
)


def build(name: str, size: float = 1.0, seed: int = 0) -> Workload:
    """Build a workload by name; ``size`` scales its request count (``--quick`` uses less)."""
    table = builders()
    if name not in table:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(table)}")
    return table[name](size=size, seed=seed)
