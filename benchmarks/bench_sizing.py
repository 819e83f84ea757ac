"""Sizing numbers for docs/sizing.md: memory of the affinity index and per replica, CPU of the
prefix path per request, and the shared-state (Redis) bytes a gateway process sends.

Everything runs in-process, on the real classes (no network, no Redis): a minute or two on
a 2-core machine.

    python benchmarks/bench_sizing.py            # prints a table, writes benchmarks/results/bench_sizing.json
    python benchmarks/bench_sizing.py --pairs 200000 --quick

- **Affinity index memory**: ``AffinityIndex`` (the prefix policy's default stride of 4, no
  byte bound in the way) filled with ``--pairs`` distinct (key, replica) pairs, recorded as
  prompts of 100 stored keys spread over 4 replicas; bytes per pair as tracemalloc sees them,
  as the index's own ``memory_bytes()`` counts them (what ``affinity_max_bytes`` is checked
  against), and as the process's RSS grows.  Once without and once with the KV cache model
  (``replica_cache_tokens``), which keeps a weight per pair.
- **Memory per replica**: a ``Gateway`` built (not started) from a quick config with 4 and
  with 132 replicas; the difference per replica (its ``Replica``, upstream client object,
  health/outlier state, ring points, per-replica index structures, metrics children).
- **Prefix path CPU**: ``PrefixPipeline`` normalize + key and ``PolicyRunner.decide`` on 4
  replicas, thread CPU time per request, for chat prompts of 1k / 8k / 32k tokens, cold
  (nothing repeats) and as a growing conversation (history repeats).
- **Shared state**: every affinity record the policy makes in those runs, encoded exactly as
  ``gateway.state.affinity_sync`` publishes it; bytes per record, and one load report's
  bytes for 4 / 64 / 256 replicas.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_prefix_path import TOOLS, Text, fleet  # noqa: E402
from gateway.config import quick_config  # noqa: E402
from gateway.prefix.pipeline import PrefixPipeline  # noqa: E402
from gateway.prefix.settings import NormalizeSettings, PrefixSettings  # noqa: E402
from gateway.routing.affinity import AffinityIndex  # noqa: E402
from gateway.routing.policies.prefix import PrefixPolicy, PrefixPolicySettings  # noqa: E402
from gateway.routing.routes import request_view  # noqa: E402
from gateway.routing.runner import PolicyRunner  # noqa: E402
from gateway.state.peer_load import load_rows  # noqa: E402
from gateway.state.wire import Record, encode  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_sizing.json"
KEYS_PER_PROMPT = 100


def rss_bytes() -> int:
    """Resident set size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def index_memory(pairs: int, modelled: bool) -> dict[str, Any]:
    """Bytes per (key, replica) pair of a filled index (no eviction: the bound is far away)."""
    names = [f"r{i}" for i in range(4)]
    rnd = random.Random(3)
    prompts = pairs // KEYS_PER_PROMPT
    gc.collect()
    rss0 = rss_bytes()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = AffinityIndex(stride=4, max_bytes=1 << 42)
    index.set_members(names)
    if modelled:
        for name in names:
            index.set_token_capacity(name, 1 << 40)
    t0 = time.process_time()
    for i in range(prompts):
        keys = [rnd.getrandbits(64) for _ in range(KEYS_PER_PROMPT * 4)]  # stride 4: a quarter is stored
        index.record(names[i & 3], keys, 40_000, (lambda d: 16 * d) if modelled else None, (len(keys), 16))
    cpu = time.process_time() - t0
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    gc.collect()
    entries = index.entries()
    out = {
        "pairs": entries,
        "modelled": modelled,
        "tracemalloc_bytes_per_pair": round(traced / entries, 1),
        "memory_bytes_per_pair": round(index.memory_bytes() / entries, 1),
        "rss_bytes_per_pair": round((rss_bytes() - rss0) / entries, 1),
        "budget_bytes_per_pair": index.entry_bytes(),
        "record_us_per_pair": round(cpu / entries * 1e6, 3),
    }
    del index
    gc.collect()
    return out


def index_memory_fresh(pairs: int, modelled: bool) -> dict[str, Any]:
    """:func:`index_memory` in a fresh process, so that its RSS is not memory a previous case freed."""
    done = subprocess.run(
        [sys.executable, __file__, "--pairs", str(pairs), "--index-case", "modelled" if modelled else "plain"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def base_process() -> dict[str, Any]:
    """RSS of a fresh process before and after building the demo config's Gateway and loading
    its vocabulary and chat template (what a gateway holds before any traffic)."""
    code = (
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "def rss_bytes():\n"
        "    with open('/proc/self/statm') as f:\n"
        "        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
        "start = rss_bytes()\n"
        "from gateway.config import load_config, packaged_default_config\n"
        "from gateway.service import Gateway\n"
        "imported = rss_bytes()\n"
        "gateway = Gateway(load_config(packaged_default_config()))\n"
        "gateway._warm_pipelines()\n"
        "print(json.dumps({'interpreter': start, 'imported': imported, 'built_and_warm': rss_bytes()}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def gateway_bytes(replicas: int) -> int:
    """tracemalloc bytes of a built (not started) Gateway with ``replicas`` replicas, one route."""
    from gateway.service import Gateway

    config = quick_config([f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(replicas)])
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    gateway = Gateway(config)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del gateway
    gc.collect()
    return used


def per_replica_memory() -> dict[str, Any]:
    small, large = 4, 132
    gateway_bytes(small)  # imports and one-time caches out of the way
    a, b = gateway_bytes(small), gateway_bytes(large)
    return {"replicas": [small, large], "bytes": [a, b], "bytes_per_replica": round((b - a) / (large - small))}


def chat_bodies(kind: str, tokens: int, n: int, text: Text) -> list[dict[str, Any]]:
    """``n`` chat bodies of about ``tokens`` prompt tokens: cold (every prompt new) or a
    conversation (one tenant system prompt + a history that grows by a turn per request)."""
    system = text.tokens(min(1500, tokens // 4))
    bodies = []
    if kind == "cold":
        for _ in range(n):
            msgs = [{"role": "system", "content": text.tokens(min(1500, tokens // 4))}]
            msgs.append({"role": "user", "content": text.tokens(tokens - min(1500, tokens // 4))})
            bodies.append({"model": "m", "messages": msgs, "tools": TOOLS})
        return bodies
    history: list[dict[str, Any]] = []
    start = tokens - len(system) / 3.4 - n * 45  # ~3.4 characters per token here; ~90 tokens a turn, mean n/2 turns
    while sum(len(m["content"]) for m in history) < start * 3.4:
        history += [{"role": "user", "content": text.tokens(100)}, {"role": "assistant", "content": text.tokens(600)}]
    for _ in range(n):
        history = [*history, {"role": "user", "content": text.tokens(30)}]
        bodies.append({"model": "m", "messages": [{"role": "system", "content": system}, *history], "tools": TOOLS})
        history = [*history, {"role": "assistant", "content": text.tokens(60)}]
    return bodies


class _Collect:
    """A record sink that keeps what the shared-state sync would publish (as its RouteSink does)."""

    def __init__(self, out: list[Record]) -> None:
        self.out = out

    def recorded(self, replica: str, stored: list[int], prompt_tokens: int | None, weights: Any) -> None:
        explicit = weights.explicit(len(stored)) if weights else None
        self.out.append(Record("chat", replica, list(stored), prompt_tokens, explicit))

    def withdrawn(self, replica: str, keys: list[int]) -> None:
        return None  # every request here is served: nothing is taken back


def prefix_path(kind: str, tokens: int, n: int) -> dict[str, Any]:
    """CPU per request of normalize + key + decide, and the bytes of the records it would publish."""
    text = Text(11)
    bodies = chat_bodies(kind, tokens, n + 10, text)
    pipeline = PrefixPipeline(NormalizeSettings(mode="relocate"), PrefixSettings())
    pool = fleet(4)
    policy = PrefixPolicy(PrefixPolicySettings(), [r.view() for r in pool])
    runner = PolicyRunner("sizing", "prefix", policy, pool)
    published: list[Record] = []
    policy.index.attach_sink(_Collect(published))
    cpu: list[float] = []
    parse: list[float] = []
    keys: list[int] = []
    tokens_seen: list[int] = []
    clock = time.thread_time
    gc.collect()
    for i, body in enumerate(bodies):
        raw = json.dumps(body).encode()
        p0 = clock()
        json.loads(raw)  # what the handler pays to parse the body before the prefix path
        parse.append(clock() - p0)
        t0 = clock()
        prepared = pipeline.prepare("chat", body)
        request = request_view("sizing", "chat", body, prepared, request_id=f"r{i}")
        runner.decide(request)
        t1 = clock()
        for r in pool:
            r.in_flight = 0
        if i >= 10:
            cpu.append(t1 - t0)
            keys.append(len(request.block_keys))
            tokens_seen.append(prepared.prompt_tokens_estimate)
    records = published[10:]
    sizes = [len(encode("pod-0123456789ab", [r])) for r in records]
    empty = len(encode("pod-0123456789ab", []))
    batch = len(encode("pod-0123456789ab", records[:16]))
    return {
        "kind": kind,
        "prompt_tokens": round(statistics.fmean(tokens_seen)),
        "keys_per_request": round(statistics.fmean(keys)),
        "stored_keys_per_record": round(statistics.fmean(len(r.keys) for r in records)),
        "cpu_ms_p50": round(statistics.median(cpu) * 1e3, 3),
        "cpu_ms_mean": round(statistics.fmean(cpu) * 1e3, 3),
        "body_bytes": len(raw),
        "json_parse_ms_p50": round(statistics.median(parse[10:]) * 1e3, 3),
        "record_bytes": round(statistics.fmean(sizes) - empty),
        "message_overhead_bytes": empty,
        "batch_of_16_bytes": batch,
    }


def load_report_bytes(replicas: int) -> int:
    report = {f"vllm-{i:03d}": (3, 12_345) for i in range(replicas)}
    message = {"v": 1, "pod": "pod-0123456789ab", "load": load_rows(report)}
    return len(json.dumps(message, separators=(",", ":")).encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1_000_000, help="(key, replica) pairs to fill the index with")
    parser.add_argument("-n", type=int, default=60, help="requests per prefix-path case")
    parser.add_argument("--quick", action="store_true", help="fewer requests, 1k and 32k only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--index-case", choices=["plain", "modelled"], help=argparse.SUPPRESS)  # internal
    args = parser.parse_args(argv)
    if args.index_case:
        print(json.dumps(index_memory(args.pairs, args.index_case == "modelled")))
        return 0
    started = time.time()
    load0 = os.getloadavg()

    index = [index_memory_fresh(args.pairs, modelled) for modelled in (False, True)]
    replica = per_replica_memory()
    base = base_process()
    n = 20 if args.quick else args.n
    cases = [("cold", 1_000), ("cold", 32_000), ("conversation", 32_000)]
    if not args.quick:
        cases[1:1] = [("cold", 8_000), ("conversation", 8_000)]
    path = [prefix_path(kind, tokens, n) for kind, tokens in cases]
    load = {str(r): load_report_bytes(r) for r in (4, 64, 256)}

    result = {
        "benchmark": "bench_sizing",
        "command": "python benchmarks/bench_sizing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "arch": platform.machine()},
        "load_average": [round(x, 2) for x in load0],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": round(time.time() - started, 1),
        "affinity_index": index,
        "per_replica": replica,
        "base_process_rss": base,
        "prefix_path": path,
        "load_report_bytes": load,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"affinity index, {index[0]['pairs']:,} (key, replica) pairs, bytes per pair:")
    print("  model     tracemalloc  memory_bytes()  RSS    budget  record µs/pair")
    for row in index:
        print(
            f"  {'KV model' if row['modelled'] else 'none':8}  {row['tracemalloc_bytes_per_pair']:>11}"
            f"  {row['memory_bytes_per_pair']:>14}  {row['rss_bytes_per_pair']:>5}  {row['budget_bytes_per_pair']:>6}"
            f"  {row['record_us_per_pair']:>14}"
        )
    print("process RSS (MiB): " + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in base.items()))
    print(f"per replica (Gateway built with {replica['replicas']}): {replica['bytes_per_replica']:,} bytes")
    print("prefix path (normalize + key + decide, 4 replicas), CPU per request and shared-state bytes per record:")
    print("  kind          tokens  keys  stored  cpu p50 ms  parse ms  record B  batch of 16 B")
    for row in path:
        print(
            f"  {row['kind']:12}  {row['prompt_tokens']:>6}  {row['keys_per_request']:>4}"
            f"  {row['stored_keys_per_record']:>6}"
            f"  {row['cpu_ms_p50']:>10}  {row['json_parse_ms_p50']:>8}  {row['record_bytes']:>8}"
            f"  {row['batch_of_16_bytes']:>13}"
        )
    print("load report bytes by replicas:", load)
    print(f"wrote {args.out} ({result['elapsed_s']} s, load average {result['load_average']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
