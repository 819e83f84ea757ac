"""Hot-path cost of KV event ingestion: events per second one core sustains.

    python benchmarks/bench_kv_events.py            # ~15 s: every scenario, median of 3
    python benchmarks/bench_kv_events.py --quick    # ~3 s smoke run

What a subscriber does per message, without the socket: decode the msgpack payload
(:mod:`gateway.kv_events.decoder`), check its sequence and apply it to the precise index
(:class:`~gateway.kv_events.ingest.Ingestor`): re-hash each stored block's ``token_ids`` into
our chained keys, update the engine-hash map and the holders.  Messages are built like a
busy engine's (vLLM 0.32's tagged maps, 64-bit integer hashes), one scheduler step each:

- ``gpu_prefill``: block size 16, each step stores 1-32 new blocks of a prompt (chained to its
  previous step) and evicts as many old ones (``BlockRemoved``, one hash each, as vLLM sends).
- ``cpu_prefill``: the same with vLLM's CPU block size 128 (fewer, larger blocks).
- ``decode_steps``: one block stored and one removed per step (long decodes filling blocks).
- ``past_window``: ``gpu_prefill`` with the index keying only each prompt's first 64 blocks
  (a 1,024-token window): the rest are kept by depth alone, not re-hashed.
- ``cpu_keyed_16``: ``cpu_prefill`` under a route hashing 16-token blocks, so each 128-token
  engine block is keyed as eight of the route's (``PreciseIndex.key_at``).

And what precise matching adds to a routing decision: the ``prefix`` policy's ``choose`` on
full-window (4,096-token) prompts held by the replicas' engines, with the precise matcher
attached and without (``--replicas``: fleet sizes, default 4 and 64).

Timed in CPU time of the thread (``time.thread_time``) over the whole scenario; "events/s" counts
``BlockStored`` + ``BlockRemoved`` events, "blocks/s" the blocks in them.  With ``--repeat N``
each figure is the median of N runs.  Results: a table on stdout and
``benchmarks/results/bench_kv_events.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgpack

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.kv_events.decoder import decode_frames  # noqa: E402
from gateway.kv_events.index import PreciseIndex  # noqa: E402
from gateway.kv_events.ingest import Ingestor  # noqa: E402
from gateway.kv_events.service import KvEvents  # noqa: E402
from gateway.kv_events.settings import KvEventsSettings  # noqa: E402
from gateway.prefix.blocks import chain_block_keys, engine_seed  # noqa: E402
from gateway.routing.base import ReplicaView, RequestView  # noqa: E402
from gateway.routing.policies.prefix import PrefixPolicy, PrefixPolicySettings  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_kv_events.json"
SCENARIOS = {
    "gpu_prefill": (16, 1, 32),
    "cpu_prefill": (128, 1, 8),
    "decode_steps": (16, 1, 1),
    "past_window": (16, 1, 32),
    "cpu_keyed_16": (128, 1, 8),
}
# the block size a route asks the index to key at, per scenario (default: the engine's own)
KEYED_AT = {"cpu_keyed_16": 16}
# the index's reach in tokens per scenario (default: every block is keyed); past_window keys the
# first 64 blocks of each prompt and keeps the rest by depth alone (gateway/kv_events/deep.py)
REACH = {"past_window": 64 * 16}


def _messages(block_size: int, low: int, high: int, steps: int, seed: int) -> tuple[list[list[bytes]], int, int]:
    """``steps`` messages: (frames, events, blocks)."""
    rnd = random.Random(seed)
    out: list[list[bytes]] = []
    live: list[int] = []
    events_total = blocks_total = 0
    next_hash = 1
    parent: int | None = None
    depth = 0
    for seq in range(steps):
        n = rnd.randint(low, high)
        if depth + n > 256 or rnd.random() < 0.1:  # a new prompt
            parent, depth = None, 0
        hashes = list(range(next_hash, next_hash + n))
        next_hash += n
        tokens = [rnd.randrange(128_000) for _ in range(n * block_size)]
        events: list[dict[str, Any]] = [
            {
                "type": "BlockStored",
                "block_hashes": [h * 0x9E3779B97F4A7C15 % (1 << 64) for h in hashes],
                "parent_block_hash": parent,
                "token_ids": tokens,
                "block_size": block_size,
                "medium": "GPU",
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        ]
        parent = events[0]["block_hashes"][-1]
        depth += n
        live.extend(events[0]["block_hashes"])
        blocks_total += n
        while len(live) > 4096:  # a full cache: evict as many as were stored, oldest first
            gone = live.pop(0)
            events.append({"type": "BlockRemoved", "block_hashes": [gone], "medium": "GPU"})
            blocks_total += 1
        events_total += len(events)
        payload = msgpack.packb([time.time(), events, 0])
        out.append([b"kv", seq.to_bytes(8, "big"), payload])
    return out, events_total, blocks_total


def ingest(name: str, messages: list[list[bytes]]) -> tuple[Ingestor, float, float]:
    """Decode and apply scenario ``name``'s ``messages`` as replica ``r0``'s subscriber does: the
    ingestor, and the CPU seconds decoding and applying took."""
    index = PreciseIndex(256 * 1024 * 1024, max_depth_tokens=REACH.get(name, 1 << 20))
    index.add("r0", "meta-llama/Llama-3.1-8B-Instruct")
    if name in KEYED_AT:
        index.key_at("r0", "route", KEYED_AT[name])
    ingestor = Ingestor(index)
    start = time.thread_time()
    decoded = [decode_frames(frames) for frames in messages]
    decode_s = time.thread_time() - start
    start = time.thread_time()
    for batch in decoded:
        ingestor.ingest("r0", batch.dp_rank, batch.seq, batch.events)
    return ingestor, decode_s, time.thread_time() - start


def run_once(name: str, steps: int, seed: int) -> dict[str, float]:
    block_size, low, high = SCENARIOS[name]
    messages, events, blocks = _messages(block_size, low, high, steps, seed)
    _, decode_s, apply_s = ingest(name, messages)
    total = decode_s + apply_s
    return {
        "messages": len(messages),
        "events": events,
        "blocks": blocks,
        "decode_us_per_event": 1e6 * decode_s / events,
        "apply_us_per_event": 1e6 * apply_s / events,
        "events_per_s": events / total,
        "blocks_per_s": blocks / total,
        "messages_per_s": len(messages) / total,
    }


def decision_fleet(
    replicas: int, precise: bool, prompts: int = 50, project: bool | None = None
) -> tuple[PrefixPolicy, list[ReplicaView], list[RequestView], list[str]]:
    """The ``prefix`` policy over ``replicas`` whose engines hold ``prompts`` full-window prompts
    (prompt ``i`` on replica ``i % replicas``, told by a ``BlockStored`` event each): the policy,
    the replicas' views, one request per prompt and each prompt's holder.

    ``project`` (not None): every replica has 100k prompt tokens of prefill queued and a 262k-token
    cache, so each match is projected forward (``kv_events.project_evictions`` = ``project``)."""
    names = [f"r{i}" for i in range(replicas)]
    events = KvEvents(KvEventsSettings(project_evictions=bool(project)), lambda: {})
    for name in names:
        events.index.add(name, "m")
        events.ingestor.feed(name).subscribed = True
        events.ingestor.ingest(name, 0, 0, [])
    queued = {} if project is None else {"pending_prefill_tokens": 100_000, "kv_cache_tokens": 262_144}
    views = [ReplicaView(name, **queued) for name in names]  # type: ignore[arg-type]
    policy = PrefixPolicy(PrefixPolicySettings(), views)
    if precise:
        policy.attach_precise(events.routing)
    rnd = random.Random(1)
    requests = []
    seq = dict.fromkeys(names, 0)  # per replica: a skipped number is a gap, which drops its entries
    for i in range(prompts):
        tokens = [rnd.randrange(128_000) for _ in range(4096)]
        hashes = [(i * 1000 + j) * 0x9E3779B97F4A7C15 % (1 << 64) for j in range(256)]
        batch = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
                 "block_size": 16, "medium": "GPU"}  # fmt: skip
        holder = names[i % replicas]
        seq[holder] += 1
        events.ingestor.ingest(
            holder, 0, seq[holder], decode_frames([b"", bytes(8), msgpack.packb([0.0, [batch], 0])]).events
        )
        keys = tuple(chain_block_keys(tokens, 16, engine_seed("m", None, None)))
        requests.append(RequestView("x", "route", "m", "chat", None, keys, 16, 4099, 4099))
    return policy, views, requests, [names[i % replicas] for i in range(prompts)]


def decision_us(
    replicas: int, precise: bool, decisions: int = 400, prompts: int = 50, project: bool | None = None
) -> float:
    """CPU microseconds per ``PrefixPolicy.choose`` over :func:`decision_fleet`."""
    policy, views, requests, _ = decision_fleet(replicas, precise, prompts, project)
    start = time.thread_time()
    for k in range(decisions):
        policy.choose(requests[k % prompts], views)
    return 1e6 * (time.thread_time() - start) / decisions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps, one run")
    parser.add_argument("--steps", type=int, default=4000, help="messages per scenario")
    parser.add_argument("--repeat", type=int, default=3, help="runs per scenario (the median is reported)")
    parser.add_argument("--replicas", type=int, action="append", help="fleet sizes for the decision cost (4, 64)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    steps, repeat = (800, 1) if args.quick else (args.steps, args.repeat)
    rows: dict[str, Any] = {}
    for name in SCENARIOS:
        runs = [run_once(name, steps, seed) for seed in range(repeat)]
        rows[name] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        rows[name]["runs"] = runs
    header = f"{'scenario':<14}{'events/s':>12}{'blocks/s':>12}{'msgs/s':>10}{'decode us/ev':>14}{'apply us/ev':>13}"
    print(header)
    for name, row in rows.items():
        print(
            f"{name:<14}{row['events_per_s']:>12,.0f}{row['blocks_per_s']:>12,.0f}{row['messages_per_s']:>10,.0f}"
            f"{row['decode_us_per_event']:>14.1f}{row['apply_us_per_event']:>13.1f}"
        )
    decisions: dict[str, Any] = {}
    for n in args.replicas or [4, 64]:
        model = statistics.median(decision_us(n, False) for _ in range(repeat))
        precise = statistics.median(decision_us(n, True) for _ in range(repeat))
        queued = statistics.median(decision_us(n, True, project=False) for _ in range(repeat))
        projected = statistics.median(decision_us(n, True, project=True) for _ in range(repeat))
        decisions[str(n)] = {
            "model_us": model,
            "precise_us": precise,
            "added_us": precise - model,
            "precise_queued_us": queued,  # every replica with queued prefill and a modelled cache
            "projected_us": projected,  # ... and kv_events.project_evictions on
            "projection_added_us": projected - queued,
        }
    head = f"{'replicas':<10}{'decision us (model)':>22}{'with precise':>15}{'added':>9}"
    print(f"\n{head}{'queued':>9}{'projected':>11}")
    for n, row in decisions.items():
        print(
            f"{n:<10}{row['model_us']:>22.1f}{row['precise_us']:>15.1f}{row['added_us']:>9.1f}"
            f"{row['precise_queued_us']:>9.1f}{row['projected_us']:>11.1f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "bench_kv_events",
                "python": platform.python_version(),
                "machine": platform.machine(),
                "steps": steps,
                "repeat": repeat,
                "scenarios": rows,
                "decision_cost": decisions,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
