"""Two tenants on one route: a batch tenant that floods in bursts, an interactive one that doesn't.

Issue 26's isolation case: without flow control every request is placed at once, so each
burst queues on the replicas in front of the interactive tenant's requests that arrive during
it; with fairness between flows (the ``x-llm-d-inference-fairness-id`` header names each
tenant) the gateway can let the interactive requests pass the burst's backlog.

- ``batch`` (the flood): jobs at Poisson times; a job is a burst of ``job_requests`` requests
  arriving within ``burst_s`` seconds, each a shared job document followed by its own
  instruction (a map step over one document: every request after the first can hit the
  document in cache, where the first placed it). Ten times the interactive tenant's requests.
- ``chat`` (interactive): users at Poisson times, each turn resending a shared system prompt
  and the user's growing history (multi-turn chat: the history is a prefix of the next turn).

Text prompts of single-token words (:mod:`benchmarks.workloads.text`) to ``/v1/completions``;
``BenchRequest.tenant`` carries the tenant (the replayers send it as the fairness header).
Deterministic for a seed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from benchmarks.workloads import BenchRequest, Workload
from benchmarks.workloads.text import completion_request, random_ids

BATCH, CHAT = "batch", "chat"


@dataclass(frozen=True, slots=True)
class TenantsSpec:
    span_s: float = 120.0
    jobs: int = 8  # batch tenant: bursts over the span
    job_requests: int = 40  # requests per burst
    burst_s: float = 2.0  # a burst's requests arrive within this
    doc_tokens: tuple[int, int] = (3000, 6000)  # the job's shared document (uniform)
    instruction_tokens: tuple[int, int] = (100, 400)
    users: int = 8  # interactive tenant: users, each with turns spread over the span
    turns: int = 4
    system_tokens: int = 1200  # the interactive tenant's shared system prompt
    turn_tokens: tuple[int, int] = (60, 300)  # each new user message
    max_tokens: int = 16


def build_tenants_workload(size: float = 1.0, seed: int = 0, spec: TenantsSpec | None = None) -> Workload:
    """Build the two-tenant workload; ``size`` scales jobs, users and the span together."""
    spec = spec or TenantsSpec()
    rng = np.random.default_rng([seed, 0x7E4A])
    span = spec.span_s * max(size, 0.1)
    requests: list[BenchRequest] = []
    jobs = max(1, round(spec.jobs * size))
    for j, start in enumerate(np.sort(rng.uniform(0.0, span * 0.9, size=jobs)).tolist()):
        doc = random_ids(rng, int(rng.integers(spec.doc_tokens[0], spec.doc_tokens[1] + 1)))
        for k, t in enumerate(np.sort(start + rng.uniform(0.0, spec.burst_s, size=spec.job_requests)).tolist()):
            ask = random_ids(rng, int(rng.integers(spec.instruction_tokens[0], spec.instruction_tokens[1] + 1)))
            requests.append(_tenant(completion_request(t, doc + ask, spec.max_tokens, f"job{j}", f"job{j}.{k}"), BATCH))
    system = random_ids(rng, spec.system_tokens)
    for u in range(max(1, round(spec.users * size))):
        history = list(system)
        for t in np.sort(rng.uniform(0.0, span, size=spec.turns)).tolist():
            history += random_ids(rng, int(rng.integers(spec.turn_tokens[0], spec.turn_tokens[1] + 1)))
            requests.append(_tenant(completion_request(t, history, spec.max_tokens, f"user{u}", "turn"), CHAT))
            history += random_ids(rng, spec.max_tokens)  # the reply, resent with the next turn
    requests.sort(key=lambda r: r.t)
    counts = {name: sum(r.tenant == name for r in requests) for name in (BATCH, CHAT)}
    return Workload(
        name="tenants",
        description=(
            f"two tenants: {BATCH} bursts {jobs} jobs x {spec.job_requests} requests within {spec.burst_s:g} s "
            f"(a shared document each), {CHAT} has {counts[CHAT]} multi-turn chat requests"
        ),
        requests=requests,
        normalize="off",
        meta={"seed": seed, "tenants": counts, "max_tokens": spec.max_tokens},
    )


def _tenant(req: BenchRequest, tenant: str) -> BenchRequest:
    return replace(req, tenant=tenant)
