"""Tokenization cost on the hot path: quicktok (what the gateway uses) against tiktoken (the reference).

    python benchmarks/bench_tokenize.py            # ~10 s
    python benchmarks/bench_tokenize.py --quick    # ~3 s smoke run

Texts of about 7,000 and 32,000 cl100k tokens (English prose with code and a little
non-English text, different every repetition so no cache helps), encoded whole with
``encode_ordinary`` semantics.  Times are CPU time of the calling thread (the shared machine's
wall clock mostly measures neighbours); the ids are checked to be identical on every text.
Results: a table on stdout and ``benchmarks/results/bench_tokenize.json``.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.tokens.tokenizer import get_reference_tokenizer, get_tokenizer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_tokenize.json"
WORDS = (  # noqa: SIM905
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "prefix cache block replica gateway tokenizer routing latency throughput conversation history"
).split()
EXTRA = ["def f(x):\n    return x * 2\n", "日本語のテキスト", "مرحبا", "naïve café", "🚀", "{'k': [1, 2, 3]}"]


def make_text(rng: random.Random, target_tokens: int) -> str:
    """English-like text of about ``target_tokens`` cl100k tokens (~1.1 tokens per word here)."""
    pieces: list[str] = []
    for i in range(int(target_tokens / 1.1)):
        pieces.append(rng.choice(EXTRA) if i % 97 == 0 else rng.choice(WORDS))
    return " ".join(pieces)


def time_encode(encode, texts: list[str]) -> list[float]:
    out = []
    for text in texts:
        t0 = time.thread_time()
        encode(text)
        out.append((time.thread_time() - t0) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("-n", type=int, default=20, help="texts per size")
    args = parser.parse_args()
    n = 5 if args.quick else args.n
    rng = random.Random(7)
    rows = []
    for size in (7_000, 32_000):
        texts = [make_text(rng, size) for _ in range(n)]
        for name in ("cl100k_base", "o200k_base"):
            fast, ref = get_tokenizer(name), get_reference_tokenizer(name)
            assert all(fast.encode(t) == ref.encode(t) for t in texts), f"{name}: ids differ"
            tokens = statistics.mean(len(ref.encode(t)) for t in texts)
            q = time_encode(fast.encode, texts)
            r = time_encode(ref.encode, texts)
            rows.append(
                {
                    "encoding": name,
                    "target_tokens": size,
                    "mean_tokens": round(tokens),
                    "quicktok_ms_median": round(statistics.median(q), 3),
                    "tiktoken_ms_median": round(statistics.median(r), 3),
                    "speedup": round(statistics.median(r) / statistics.median(q), 2),
                    "identical_ids": True,
                }
            )
        for name in ("llama3", "qwen3"):
            q = time_encode(get_tokenizer(name).encode, texts)
            rows.append(
                {
                    "encoding": name,
                    "target_tokens": size,
                    "mean_tokens": round(statistics.mean(len(get_tokenizer(name).encode(t)) for t in texts)),
                    "quicktok_ms_median": round(statistics.median(q), 3),
                    "tiktoken_ms_median": None,
                    "speedup": None,
                    "identical_ids": None,
                }
            )
    print(f"{'encoding':<12} {'tokens':>7} {'quicktok ms':>12} {'tiktoken ms':>12} {'speedup':>8}")
    for r in rows:
        tk = "-" if r["tiktoken_ms_median"] is None else f"{r['tiktoken_ms_median']:.3f}"
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        print(f"{r['encoding']:<12} {r['mean_tokens']:>7} {r['quicktok_ms_median']:>12.3f} {tk:>12} {sp:>8}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {"texts_per_size": n, "python": platform.python_version(), "machine": platform.machine(), "rows": rows},
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
