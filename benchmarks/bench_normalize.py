"""Cost of normalization alone for a 32k-character system prompt (issue 9: <= 1 ms).

    python benchmarks/bench_normalize.py            # 300 requests per case
    python benchmarks/bench_normalize.py -n 1000

Cases (``relocate``, default settings: detectors, learner of what varies, discovery on):

- ``static``: the same 32k-character prompt every request (look-alike values that never change).
- ``timestamp``: a fresh ISO timestamp and request id at the top (detected, moved once learned).
- ``unknown_value``: a fresh value no detector knows (discovered, then moved).
- ``new_text``: a different 32k prompt every request (worst case: the discovery slot is
  re-hashed every time and nothing repeats).

Timed in CPU time of the calling thread (``time.thread_time_ns``) after a warm-up of 20
requests and, as the gateway does once started, ``gc.freeze()`` of what was built before;
p50 / p99 / max in microseconds.  Results: a table and
``benchmarks/results/bench_normalize.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.prefix.normalize import Normalizer
from gateway.prefix.settings import NormalizeSettings

CHARS = 32_000
WORDS = [
    "the",
    "model",
    "answers",
    "questions",
    "about",
    "orders",
    "invoices",
    "refunds",
    "and",
    "shipping",
    "for",
    "every",
    "customer",
]


def prose(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        sentence = " ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:chars]


STATIC_BITS = "Knowledge cutoff: 2024-06-01. Model gpt-4o-2024-08-06. Office 9:00-17:00. Call 2125551234.\n"


def cases(rng: random.Random) -> dict[str, Callable[[int], dict[str, Any]]]:
    base = STATIC_BITS + prose(rng, CHARS - len(STATIC_BITS))

    def body(system: str) -> dict[str, Any]:
        return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}

    return {
        "static": lambda i: body(base),
        "timestamp": lambda i: body(f"Now: 2025-03-04T05:{i // 60 % 60:02d}:{i % 60:02d}Z req_{i:06d}k9x0\n" + base),
        "unknown_value": lambda i: body(f"现在是2025年3月4日 星期二 {i % 24}点{i % 60}分。\n" + base),
        "new_text": lambda i: body(prose(rng, CHARS)),
    }


def run(n: int) -> list[dict[str, Any]]:
    rng = random.Random(7)
    rows = []
    for name, make in cases(rng).items():
        norm = Normalizer(NormalizeSettings(mode="relocate"))
        bodies = [make(i) for i in range(n + 20)]
        for b in bodies[:20]:
            norm.apply("chat", b)
        gc.collect()  # as the gateway does once started (gateway.service: gc.freeze): the
        gc.freeze()  # long-lived heap (here: the prepared bodies) is not rescanned per request
        samples = []
        for b in bodies[20:]:
            t0 = time.thread_time_ns()
            norm.apply("chat", b)
            samples.append((time.thread_time_ns() - t0) / 1000)
        samples.sort()
        rows.append(
            {
                "case": name,
                "chars": len(bodies[-1]["messages"][0]["content"]),
                "p50_us": round(statistics.median(samples), 1),
                "p99_us": round(samples[int(len(samples) * 0.99) - 1], 1),
                "max_us": round(samples[-1], 1),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=300, help="timed requests per case")
    args = parser.parse_args()
    rows = run(args.n)
    print(f"{'case':<16}{'chars':>8}{'p50 µs':>10}{'p99 µs':>10}{'max µs':>10}")
    for r in rows:
        print(f"{r['case']:<16}{r['chars']:>8}{r['p50_us']:>10}{r['p99_us']:>10}{r['max_us']:>10}")
    out = Path(__file__).parent / "results" / "bench_normalize.json"
    out.write_text(json.dumps({"python": platform.python_version(), "n": args.n, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
