"""Fuzzing: thousands of malformed and hostile requests against a real gateway process.

    python benchmarks/bench_fuzz.py                       # >= 10,000 requests, a few minutes
    python benchmarks/bench_fuzz.py --requests 1000       # a quick run

One gateway process (``prefix-gateway serve``, the ``prefix`` policy so every request runs
the whole prefix pipeline, header/body timeouts of 2 s) in front of two instant simulated
replicas, and this process sending (see ``benchmarks/fuzz_cases.py``):

1. hypothesis-generated bodies for the three endpoints: wrong types anywhere, lone
   surrogates and control characters in every string, invalid UTF-8, truncated and
   spliced JSON;
2. fixed hostile bodies: nesting up to 100,000 levels, bodies at and over the size limit,
   token ids past the context window, 10k messages;
3. raw-socket garbage: unknown methods, broken request lines and headers, lying
   Content-Length, bad chunked encoding, a 10 MB header, 20,000 headers, TLS and HTTP/2
   prefaces, random bytes;
4. slow partial requests (half stop in the head, half in the body) while normal requests
   are served.

Counted, all must be 0: gateway 5xx, error bodies not in OpenAI's shape, requests with no
answer, tracebacks and ERROR lines in the gateway's log, a crashed gateway, and slow
connections still open after the timeouts.  Results: a table on stdout and
``benchmarks/results/bench_fuzz.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fuzz_cases import Tally, run_bodies, run_hostile, run_raw, run_slow  # noqa: E402
from benchmarks.processes import serve_gateway  # noqa: E402
from gateway.sim.launcher import run_replicas  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_fuzz.json"
MAX_BODY = 10 * 1024 * 1024
TIMEOUT_S = 2.0


def fuzz_config(replica_urls: list[str]) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 0, "header_timeout_s": TIMEOUT_S, "body_timeout_s": TIMEOUT_S},
        "logging": {"summary_interval_s": 0},
        "replicas": [{"name": f"r{i}", "url": url} for i, url in enumerate(replica_urls)],
        "routes": [{"name": "fuzz", "policy": "prefix"}],
    }


def log_findings(text: str) -> dict[str, Any]:
    tracebacks = text.count("Traceback (most recent call last)")
    errors = [line for line in text.splitlines() if re.search(r"\b(ERROR|CRITICAL)\b", line)]
    return {"tracebacks": tracebacks, "error_lines": len(errors), "error_examples": errors[:5]}


def run(requests: int, slow: int, seed: int) -> dict[str, Any]:
    sim_options = {"time_scale": 0, "disable_uvicorn_access_log": True, "disable_log_stats": True}
    with (
        tempfile.TemporaryDirectory(prefix="bench-fuzz-") as tmp,
        run_replicas(2, log_dir=Path(tmp), **sim_options) as urls,
    ):
        log_path = Path(tmp) / "gateway.log"
        with serve_gateway(fuzz_config(urls), log_path) as (url, proc):
            host, port = url.removeprefix("http://").rsplit(":", 1)
            tallies = {name: Tally() for name in ("bodies", "hostile", "raw")}
            t0 = time.monotonic()
            run_hostile(url, MAX_BODY, tallies["hostile"], repeat=2)
            run_raw(host, int(port), tallies["raw"], seed=seed, repeat=2)
            remaining = max(0, requests - tallies["hostile"].sent - tallies["raw"].sent)
            run_bodies(url, remaining, tallies["bodies"], seed=seed)
            slow_result = run_slow(host, int(port), url, slow, deadline_s=TIMEOUT_S * 2 + 5)
            elapsed = time.monotonic() - t0
            alive = proc.poll() is None
            try:
                healthy = httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                healthy = False
        log = log_findings(log_path.read_text(errors="replace"))
    total = {
        k: sum(t.as_dict()[k] for t in tallies.values())
        for k in ("sent", "gateway_5xx", "non_openai_errors", "no_answer")
    }
    return {
        "requests": total,
        "families": {name: tally.as_dict() for name, tally in tallies.items()},
        "slow_partial": slow_result,
        "log": log,
        "gateway_alive_and_healthy": alive and healthy,
        "elapsed_s": round(elapsed, 1),
        "settings": {"requests": requests, "slow": slow, "seed": seed, "header_body_timeout_s": TIMEOUT_S},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def table(result: dict[str, Any]) -> str:
    rows = [("family", "sent", "gateway 5xx", "non-OpenAI errors", "no answer")]
    for name, fam in result["families"].items():
        rows.append((name, fam["sent"], fam["gateway_5xx"], fam["non_openai_errors"], fam["no_answer"]))
    t = result["requests"]
    rows.append(("TOTAL", t["sent"], t["gateway_5xx"], t["non_openai_errors"], t["no_answer"]))
    widths = [max(len(str(r[i])) for r in rows) for i in range(5)]
    lines = [
        "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    slow = result["slow_partial"]
    lines += [
        "",
        f"slow partial requests: {slow['opened']} opened, {slow['still_open_after_deadline']} still open after "
        f"{slow['deadline_s']:.0f} s; normal requests served meanwhile {slow['normal_requests_served_meanwhile']}",
        f"gateway log: {result['log']['tracebacks']} tracebacks, {result['log']['error_lines']} ERROR lines; "
        f"gateway alive and healthy after the run: {result['gateway_alive_and_healthy']}",
        f"elapsed {result['elapsed_s']} s",
    ]
    for name, fam in result["families"].items():
        lines.append(f"{name} statuses: {fam['statuses']}")
        lines += [f"  bad: {e}" for e in fam["examples"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000, help="requests in all (bodies fill up the rest)")
    parser.add_argument("--slow", type=int, default=200, help="slow partial connections")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/bench_fuzz.json")
    args = parser.parse_args(argv)
    result = run(args.requests, args.slow, args.seed)
    print(table(result))
    if not args.no_save:
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    bad = result["requests"]
    clean = (
        bad["gateway_5xx"] == 0
        and bad["non_openai_errors"] == 0
        and bad["no_answer"] == 0
        and result["log"]["tracebacks"] == 0
        and result["gateway_alive_and_healthy"]
        and result["slow_partial"]["still_open_after_deadline"] == 0
    )
    print("PASS" if clean else "FAIL")
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
