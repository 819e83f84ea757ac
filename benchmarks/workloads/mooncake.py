"""Replay of the public Mooncake (FAST'25) traces as text prompts of known token length.

The traces carry no text, only one prefix-hash id per 512-token block (see
``shared/workloads/README.md``).  Replay rules, as that README recommends:

- each distinct ``hash_id`` becomes a fixed pseudo-random block of ``block_tokens`` (512)
  token ids, drawn from a PRNG seeded by ``(trace namespace, hash_id)`` alone, so equal
  id prefixes are equal token prefixes and different ids share nothing;
- the prompt is the blocks of ``hash_ids[:-1]`` plus the first
  ``input_length - 512 * (len(hash_ids) - 1)`` tokens of the last block;
- prompts go to ``/v1/completions`` as *text*: the ids are drawn from the pool of cl100k
  tokens that are one whole word each (``text.word_pool``), so the text encodes back to
  exactly those ids under cl100k, and under any BPE vocabulary a shared block prefix stays a
  shared token prefix (words never merge across their leading space).  Text rather than
  token-id lists because the peer router in the benchmark (SGLang's ``cache_aware``) accepts
  string prompts only, and every row must get the same requests.

Shrinking, so that one replay takes seconds on 2 cores:

- a contiguous time window of the trace is kept (``window_s``; the synthetic trace whole,
  the first 20 minutes of the conversation trace);
- inside it, whole *sessions* are sampled, never single requests: the trace's reuse is a
  prefix tree, so requests are grouped by their hash id at ``session_depth`` (the first
  block for the synthetic trace, about one per conversation; the second block for the
  conversation trace, whose first block is the system prompt shared by every request) and
  a seeded ``session_fraction`` of the groups is kept with all their requests.  Sampling
  every k-th request would destroy session reuse; sampling groups keeps it, so the window's
  hit ceiling stays close to the whole trace's (~34 % and ~65 %), whereas a short contiguous
  window alone keeps only 5-15 %;
- output lengths are capped at ``max_output_tokens`` (16): decode time is not what prefix
  routing changes, and each output token is one SSE chunk of CPU work on this machine.

The session group id is also sent as ``x-session-id``: the closest thing to a conversation id
the trace has, which is what an application would put in that header.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from benchmarks.workloads import Workload
from benchmarks.workloads.text import completion_request, random_ids

WORKLOADS_DIR_ENV = "PREFIX_GATEWAY_WORKLOADS_DIR"
TRACE_BLOCK = 512  # tokens per hash id in the published traces


def workloads_dir() -> Path:
    """Where the trace files live: ``$PREFIX_GATEWAY_WORKLOADS_DIR`` or ``<repo>/../shared/workloads``."""
    env = os.environ.get(WORKLOADS_DIR_ENV)
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    for candidate in (repo / "shared" / "workloads", repo.parent / "shared" / "workloads"):
        if candidate.is_dir():
            return candidate
    return repo.parent / "shared" / "workloads"


@dataclass(frozen=True, slots=True)
class MooncakeSpec:
    """How one trace is cut down and replayed."""

    name: str
    file: str
    namespace: str  # keeps two traces' blocks apart
    session_depth: int  # hash-id position that identifies a session group
    session_fraction: float
    window_s: tuple[float, float]
    max_output_tokens: int = 16
    block_tokens: int = TRACE_BLOCK


CONVERSATION = MooncakeSpec(
    name="mooncake_conversation",
    file="mooncake_conversation_trace.jsonl",
    namespace="mooncake-conversation",
    session_depth=1,
    session_fraction=0.10,
    window_s=(0.0, 1200.0),
)
SYNTHETIC = MooncakeSpec(
    name="mooncake_synthetic",
    file="mooncake_synthetic_trace.jsonl",
    namespace="mooncake-synthetic",
    session_depth=0,
    session_fraction=0.10,
    window_s=(0.0, 1100.0),
)


def load_trace(path: Path) -> list[dict[str, Any]]:
    """All rows of a trace file, in file (= timestamp) order."""
    with path.open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


def session_key(row: dict[str, Any], index: int, depth: int) -> str:
    """The group a request belongs to: its hash id at ``depth``, or itself when shorter."""
    ids = row["hash_ids"]
    return f"h{ids[depth]}" if len(ids) > depth else f"solo{index}"


def _unit(seed: int, key: str) -> float:
    """A stable pseudo-random number in [0, 1) for a (seed, key) pair."""
    return xxhash.xxh64_intdigest(f"{seed}:{key}".encode()) / 2.0**64


def sample_sessions(
    rows: list[dict[str, Any]], spec: MooncakeSpec, fraction: float, seed: int
) -> list[tuple[int, str]]:
    """Indices (into ``rows``) and session keys of the kept requests, in arrival order."""
    lo, hi = spec.window_s
    kept = []
    for i, row in enumerate(rows):
        if not lo * 1000 <= row["timestamp"] < hi * 1000:
            continue
        key = session_key(row, i, spec.session_depth)
        if _unit(seed, key) < fraction:
            kept.append((i, key))
    return kept


class BlockTokens:
    """hash id -> its fixed block of word-pool token ids (memoized: reused blocks are built once)."""

    def __init__(self, namespace: str, block_tokens: int = TRACE_BLOCK) -> None:
        self.namespace = namespace
        self.block_tokens = block_tokens
        self._cache: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        cached = self._cache.get(hash_id)
        if cached is None:
            seed = xxhash.xxh64_intdigest(f"{self.namespace}:{hash_id}".encode())
            cached = random_ids(np.random.default_rng(seed), self.block_tokens)
            self._cache[hash_id] = cached
        return cached

    def prompt(self, hash_ids: list[int], input_length: int) -> list[int]:
        """Blocks of all ids but the last, then the head of the last block up to ``input_length``."""
        tokens: list[int] = []
        for hash_id in hash_ids[:-1]:
            tokens.extend(self.block(hash_id))
        tail = input_length - self.block_tokens * (len(hash_ids) - 1)
        tokens.extend(self.block(hash_ids[-1])[: max(0, tail)])
        return tokens


def build_mooncake(spec: MooncakeSpec, size: float = 1.0, seed: int = 0, directory: Path | None = None) -> Workload:
    """Build a trace replay; ``size`` scales the session fraction (so the request count)."""
    path = (directory or workloads_dir()) / spec.file
    if not path.is_file():
        raise FileNotFoundError(f"trace {path} not found (set {WORKLOADS_DIR_ENV} to the folder holding {spec.file})")
    rows = load_trace(path)
    fraction = min(1.0, spec.session_fraction * size)
    blocks = BlockTokens(spec.namespace, spec.block_tokens)
    requests = []
    kept_rows = []
    t0 = spec.window_s[0]
    for index, key in sample_sessions(rows, spec, fraction, seed):
        row = rows[index]
        kept_rows.append(row)
        prompt = blocks.prompt(row["hash_ids"], row["input_length"])
        max_tokens = max(1, min(int(row["output_length"]), spec.max_output_tokens))
        requests.append(completion_request(row["timestamp"] / 1000.0 - t0, prompt, max_tokens, key, "trace"))
    return Workload(
        name=spec.name,
        description=(
            f"{spec.file}: window {spec.window_s[0]:.0f}-{spec.window_s[1]:.0f} s, "
            f"{fraction:.0%} of sessions (whole prefix subtrees), outputs capped at {spec.max_output_tokens}"
        ),
        requests=requests,
        normalize="off",
        meta={
            "seed": seed,
            "session_fraction": fraction,
            "window_s": list(spec.window_s),
            "max_output_tokens": spec.max_output_tokens,
            "block_tokens": spec.block_tokens,
            "ceiling_hit_rate": round(ceiling_hit_rate(kept_rows, spec.block_tokens), 4),
        },
    )


def ceiling_hit_rate(rows: list[dict[str, Any]], block_tokens: int = TRACE_BLOCK) -> float:
    """Token-weighted hit rate of an infinite cache over these rows, at trace-block granularity.

    A block hits when its id was seen before (ids are prefix hashes, so this is the longest
    cached prefix); partial last blocks never count, as in vLLM.
    """
    seen: set[int] = set()
    hit = total = 0
    for row in rows:
        ids = row["hash_ids"]
        total += row["input_length"]
        for j, hash_id in enumerate(ids):
            if hash_id in seen and j < len(ids) - 1:
                hit += block_tokens
            seen.add(hash_id)
    return hit / total if total else 0.0


def build_mooncake_conversation(size: float = 1.0, seed: int = 0) -> Workload:
    return build_mooncake(CONVERSATION, size=size, seed=seed)


def build_mooncake_synthetic(size: float = 1.0, seed: int = 0) -> Workload:
    return build_mooncake(SYNTHETIC, size=size, seed=seed)
