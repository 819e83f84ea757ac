"""RAG workload: a shared system prompt, then retrieved documents, then the user's question.

A shape none of the other workloads has: the reusable part of a prompt is not one tenant's
head or one conversation's history but a *document* from a large, Zipf-popular corpus, and it
sits behind a prefix every request shares.  What it checks:

- the shared system prompt is a fork every request goes on from, so new requests must not
  pile onto its first holder (the head-demand rule gives it every replica);
- each document is a fork too (many questions follow it): a popular document's requests
  should find a replica holding it, a rare one costs one prefill wherever it lands;
- the corpus (~1.3 M tokens) exceeds one replica's KV cache and is about the
  fleet's, so where documents land decides how much of it the fleet keeps: piling popular
  documents on one replica evicts the others there.

Single-turn requests (a question never continues another), some with two documents (only the
first is a shared prefix: the pair's order is the retriever's ranking, so two requests with
the same first document share it).  Text prompts of single-token words
(:mod:`benchmarks.workloads.text`) to ``/v1/completions`` like the Mooncake replays; Poisson
arrivals.  Deterministic for a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.workloads import Workload
from benchmarks.workloads.text import completion_request, random_ids


@dataclass(frozen=True, slots=True)
class RagSpec:
    requests: int = 480
    span_s: float = 240.0
    documents: int = 320
    doc_tokens: tuple[int, int] = (1500, 7000)  # uniform
    zipf_s: float = 1.0  # document popularity ~ 1 / rank^s
    system_tokens: int = 700
    question_tokens: tuple[int, int] = (20, 160)
    two_docs_share: float = 0.3
    max_tokens: int = 16


def build_rag_workload(size: float = 1.0, seed: int = 0, spec: RagSpec | None = None) -> Workload:
    spec = spec or RagSpec()
    rng = np.random.default_rng([seed, 0x7A6])
    system = random_ids(rng, spec.system_tokens)
    lengths = rng.integers(spec.doc_tokens[0], spec.doc_tokens[1] + 1, size=spec.documents)
    docs = [random_ids(rng, int(n)) for n in lengths]
    weights = 1.0 / np.arange(1, spec.documents + 1) ** spec.zipf_s
    weights /= weights.sum()
    n = max(2, round(spec.requests * size))
    span = spec.span_s * max(size, 0.1)
    times = np.sort(rng.uniform(0.0, span, size=n))
    requests = []
    for i in range(n):
        count = 2 if rng.random() < spec.two_docs_share else 1
        picked = rng.choice(spec.documents, size=count, replace=False, p=weights).tolist()
        question = random_ids(rng, int(rng.integers(spec.question_tokens[0], spec.question_tokens[1] + 1)))
        prompt = list(system)
        for d in picked:
            prompt += docs[d]
        prompt += question
        requests.append(completion_request(float(times[i]), prompt, spec.max_tokens, f"q{i}", f"doc{picked[0]}"))
    corpus = int(lengths.sum())
    return Workload(
        name="rag",
        description=(
            f"retrieval: a {spec.system_tokens}-token system prompt, then 1-2 of {spec.documents} documents "
            f"({corpus / 1e6:.2f} M tokens, Zipf s={spec.zipf_s}), then a question; single-turn"
        ),
        requests=requests,
        normalize="off",
        meta={"seed": seed, "documents": spec.documents, "corpus_tokens": corpus, "max_tokens": spec.max_tokens},
    )
