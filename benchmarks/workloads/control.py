"""Control workload: no shared prefixes at all.

Every prompt is unique from its first token (token 0 is the request's own index, the rest is
seeded noise), so no policy can get a cache hit and the only thing routing can change is how
evenly work is spread.  The prefix policy must then be as good as ``least_loaded``: this is
the "never worse than least-load when prompts share nothing" requirement.

Prompts are text sent to ``/v1/completions``, made of single-token words (``text.word_pool``,
so a prompt of N words is N cl100k tokens; text because the peer router in the benchmark takes
string prompts only); lengths are log-normal (median ~3k tokens,
clipped to [256, 16k]) so that some requests are much more expensive than others, which is
what makes load-aware spreading matter; arrivals are Poisson.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from benchmarks.workloads import Workload
from benchmarks.workloads.text import completion_request, random_ids, word_pool


@dataclass(frozen=True, slots=True)
class ControlSpec:
    requests: int = 320
    span_s: float = 120.0
    median_tokens: int = 3000
    sigma: float = 0.8
    min_tokens: int = 256
    max_tokens_prompt: int = 16_000
    max_tokens: int = 16


def build_control_workload(size: float = 1.0, seed: int = 0, spec: ControlSpec | None = None) -> Workload:
    spec = spec or ControlSpec()
    rng = np.random.default_rng([seed, 0xC0117])
    n = max(2, round(spec.requests * size))
    span = spec.span_s * max(size, 0.1)
    times = np.sort(rng.uniform(0.0, span, size=n))
    lengths = np.clip(
        rng.lognormal(math.log(spec.median_tokens), spec.sigma, size=n), spec.min_tokens, spec.max_tokens_prompt
    ).astype(int)
    pool = word_pool()
    requests = []
    for i in range(n):
        length = int(lengths[i])
        # The first word (past the pool's size: the first two) differs between any two requests, so
        # not even the first block is shared.
        head = [pool[i % len(pool)], pool[i // len(pool) % len(pool)]]
        prompt = head + random_ids(rng, length - 2)
        requests.append(completion_request(float(times[i]), prompt, spec.max_tokens, f"u{i}", "unique"))
    return Workload(
        name="control",
        description=f"no shared prefixes: {n} unique text prompts, log-normal lengths, median {spec.median_tokens}",
        requests=requests,
        normalize="off",
        meta={"seed": seed, "max_tokens": spec.max_tokens},
    )
