"""Fuzzing: thousands of malformed and hostile requests against a real gateway process.

    python benchmarks/bench_fuzz.py                       # ~2,000 requests and 300 uploads, about a minute
    python benchmarks/bench_fuzz.py --requests 10000      # the long run

One gateway process (``prefix-gateway serve``, the ``prefix`` policy so every request runs
the whole prefix pipeline, header/body timeouts of 2 s, per-key limits on, process-wide caps
of 200 requests in flight and 64 MiB of buffered bodies) in front of two instant simulated
replicas, a second one with client API keys on, and this process sending (see
``benchmarks/fuzz_cases.py``, ``fuzz_keys.py``, ``fuzz_uploads.py``):

1. hypothesis-generated bodies for the three endpoints: wrong types anywhere, lone
   surrogates and control characters in every string, invalid UTF-8, truncated and
   spliced JSON;
2. fixed hostile bodies: nesting up to 100,000 levels, bodies at and over the size limit,
   token ids past the context window, 10k messages;
3. raw-socket garbage: unknown methods, broken request lines and headers, lying
   Content-Length, bad chunked encoding, a 10 MB header, 20,000 headers, TLS and HTTP/2
   prefaces, random bytes;
4. the many spellings of one API key (``Bearer``/``bearer``/``BEARER``, extra spaces, tabs,
   no scheme) and rotating made-up tokens, to both gateways (keys on and off);
5. slow and oversize uploads, hundreds at once: bodies a few bytes at a time, heads that
   declare a body and stop, 3.5 MiB sent of 4 MiB declared, Content-Length over the limit;
   the gateway's RSS is sampled throughout and must stay within the caps' bound;
6. slow partial requests (half stop in the head, half in the body) while normal requests
   are served.

Counted, all must be 0: gateway 5xx, error bodies not in OpenAI's shape, requests with no
answer, failed health probes during the uploads, tracebacks and ERROR lines in the
gateway's log, a crashed gateway, and slow connections still open after the timeouts.
**A 503 is a failure unless it is an intended shed**: ``server_overloaded`` with a
``retry-after`` header (a cap was full); those are counted apart ("503 shed" column), any
other 5xx (500, 502, a 503 without them) is in "gateway 5xx".  Results: a table on stdout
and ``benchmarks/results/bench_fuzz.json``.
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
from benchmarks.fuzz_keys import run_keys  # noqa: E402
from benchmarks.fuzz_uploads import run_uploads  # noqa: E402
from benchmarks.processes import serve_gateway  # noqa: E402
from benchmarks.procstat import RssSampler  # noqa: E402
from gateway.config import sha256_hex  # noqa: E402
from gateway.sim.launcher import run_replicas  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_fuzz.json"
MAX_BODY = 10 * 1024 * 1024
TIMEOUT_S = 2.0
MAX_CONCURRENCY = 200
MAX_BUFFERED = 64 * 1024 * 1024
#: what the uploads may add to the gateway's RSS: the bodies the cap admits (64 MiB) and as
#: much again for connections, parsing and the allocator's slack.  Measured: +20 MiB with the
#: caps, +208 MiB without (``--uncapped``: the bulk uploads' 3.5 MiB each are all held)
RSS_GROWTH_BOUND = MAX_BUFFERED + 64 * 1024 * 1024
API_KEY = "fuzz-key-0123456789"


def fuzz_config(replica_urls: list[str], *, keys: bool = False, capped: bool = True) -> dict[str, Any]:
    """``capped=False``: caps far above anything the run sends (what the gateway did before them)."""
    server = {
        "host": "127.0.0.1",
        "port": 0,
        "header_timeout_s": TIMEOUT_S,
        "body_timeout_s": TIMEOUT_S,
        "max_concurrency": MAX_CONCURRENCY if capped else 1_000_000,
        "max_buffered_body_bytes": MAX_BUFFERED if capped else 1 << 40,
    }
    config: dict[str, Any] = {
        "server": server,
        "logging": {"summary_interval_s": 0},
        # per-key limits on, far above the fuzzer's rate: every spelling and token meets a bucket
        "limits": {"per_key_requests_per_s": 100_000, "per_key_burst": 100_000},
        "replicas": [{"name": f"r{i}", "url": url} for i, url in enumerate(replica_urls)],
        "routes": [{"name": "fuzz", "policy": "prefix"}],
    }
    if keys:
        config["auth"] = {"api_keys_sha256": [sha256_hex(API_KEY)]}
    return config


def _mib(n: int) -> float:
    return round(n / 2**20, 1)


def log_findings(text: str) -> dict[str, Any]:
    tracebacks = text.count("Traceback (most recent call last)")
    errors = [line for line in text.splitlines() if re.search(r"\b(ERROR|CRITICAL)\b", line)]
    return {"tracebacks": tracebacks, "error_lines": len(errors), "error_examples": errors[:5]}


def run(
    requests: int,
    slow: int,
    seed: int,
    uploads: int = 300,
    key_rounds: int = 10,
    tokens: int = 300,
    capped: bool = True,
) -> dict[str, Any]:
    sim_options = {"time_scale": 0, "disable_uvicorn_access_log": True, "disable_log_stats": True}
    with (
        tempfile.TemporaryDirectory(prefix="bench-fuzz-") as tmp,
        run_replicas(2, log_dir=Path(tmp), **sim_options) as urls,
    ):
        log_path = Path(tmp) / "gateway.log"
        keys_log = Path(tmp) / "gateway-keys.log"
        with (
            serve_gateway(fuzz_config(urls, capped=capped), log_path) as (url, proc),
            serve_gateway(fuzz_config(urls, keys=True), keys_log) as (keys_url, keys_proc),
        ):
            host, port = url.removeprefix("http://").rsplit(":", 1)
            keys_host, keys_port = keys_url.removeprefix("http://").rsplit(":", 1)
            tallies = {name: Tally() for name in ("bodies", "hostile", "raw", "keys", "uploads", "neighbours")}
            rss = RssSampler(proc.pid)
            t0 = time.monotonic()
            run_hostile(url, MAX_BODY, tallies["hostile"], repeat=2)
            run_raw(host, int(port), tallies["raw"], seed=seed, repeat=2)
            keys = {
                "auth_on": run_keys(keys_host, int(keys_port), API_KEY, tallies["keys"], key_rounds, tokens, seed),
                "auth_off": run_keys(host, int(port), API_KEY, tallies["keys"], key_rounds, tokens, seed + 1),
            }
            fixed = sum(tallies[n].sent for n in ("hostile", "raw", "keys"))
            if requests > fixed:
                run_bodies(url, requests - fixed, tallies["bodies"], seed=seed)
            rss_before = rss.mark()
            during = RssSampler(proc.pid, interval_s=0.05)
            upload_result = run_uploads(
                host, int(port), url, uploads, MAX_BODY, TIMEOUT_S + 5, tallies["uploads"], tallies["neighbours"]
            )
            rss_after = during.stop()
            slow_result = run_slow(host, int(port), url, slow, deadline_s=TIMEOUT_S * 2 + 5)
            elapsed = time.monotonic() - t0
            rss_end = rss.stop()
            alive = proc.poll() is None and keys_proc.poll() is None
            try:
                healthy = all(httpx.get(f"{u}/health", timeout=5).status_code == 200 for u in (url, keys_url))
            except httpx.HTTPError:
                healthy = False
        log = log_findings(log_path.read_text(errors="replace") + keys_log.read_text(errors="replace"))
    growth = during.peak_bytes - rss_before
    upload_result["rss_mib"] = {
        "at_start": _mib(rss.start_bytes),
        "before_uploads": _mib(rss_before),
        "peak_during_uploads": _mib(during.peak_bytes),
        "after_uploads": _mib(rss_after),
        "peak_over_run": _mib(rss.peak_bytes),
        "at_end": _mib(rss_end),
        "growth_during_uploads": _mib(growth),
        "growth_bound": _mib(RSS_GROWTH_BOUND),
    }
    upload_result["rss_bounded"] = growth <= RSS_GROWTH_BOUND
    total = {
        k: sum(t.as_dict()[k] for t in tallies.values())
        for k in ("sent", "gateway_5xx", "shed_503", "non_openai_errors", "no_answer")
    }
    return {
        "requests": total,
        "families": {name: tally.as_dict() for name, tally in tallies.items()},
        "keys": keys,
        "uploads": upload_result,
        "slow_partial": slow_result,
        "log": log,
        "gateway_alive_and_healthy": alive and healthy,
        "elapsed_s": round(elapsed, 1),
        "settings": {
            "requests": requests,
            "slow": slow,
            "uploads": uploads,
            "key_rounds": key_rounds,
            "tokens": tokens,
            "seed": seed,
            "header_body_timeout_s": TIMEOUT_S,
            "max_concurrency": MAX_CONCURRENCY if capped else None,
            "max_buffered_body_bytes": MAX_BUFFERED if capped else None,
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def table(result: dict[str, Any]) -> str:
    cols = ("sent", "gateway_5xx", "shed_503", "non_openai_errors", "no_answer")
    rows: list[tuple[Any, ...]] = [("family", "sent", "gateway 5xx", "503 shed", "non-OpenAI errors", "no answer")]
    for name, fam in result["families"].items():
        rows.append((name, *(fam[c] for c in cols)))
    t = result["requests"]
    rows.append(("TOTAL", *(t[c] for c in cols)))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    slow, up = result["slow_partial"], result["uploads"]
    rss = up["rss_mib"]
    lines += [
        "gateway 5xx: failures (500, 502, 504, a 503 without server_overloaded + retry-after); "
        "503 shed: intended (a process-wide cap was full), not failures",
        "",
        f"uploads: {up['clients']} at once in {up['elapsed_s']} s; health probes meanwhile {up['health_probes']} "
        f"({up['health_probes_failed']} failed); bulk bytes sent {up['bulk_bytes_sent'] / 2**20:.0f} MiB",
        f"gateway RSS (MiB): start {rss['at_start']}, before uploads {rss['before_uploads']}, peak during uploads "
        f"{rss['peak_during_uploads']} (+{rss['growth_during_uploads']}, bound +{rss['growth_bound']}: "
        f"{'bounded' if up['rss_bounded'] else 'OVER'}), peak over the run {rss['peak_over_run']}, end {rss['at_end']}",
        f"slow partial requests: {slow['opened']} opened, {slow['still_open_after_deadline']} still open after "
        f"{slow['deadline_s']:.0f} s; normal requests served meanwhile {slow['normal_requests_served_meanwhile']}",
        f"gateway log: {result['log']['tracebacks']} tracebacks, {result['log']['error_lines']} ERROR lines; "
        f"gateways alive and healthy after the run: {result['gateway_alive_and_healthy']}",
        f"elapsed {result['elapsed_s']} s",
    ]
    for name, fam in result["families"].items():
        lines.append(f"{name} statuses: {fam['statuses']}")
        lines += [f"  bad: {e}" for e in fam["examples"]]
    for kind, statuses in up["statuses_by_kind"].items():
        lines.append(f"upload {kind}: {statuses}")
    for gateway, keys in result["keys"].items():
        lines.append(f"key spellings, {gateway}: " + "; ".join(f"{n} {s}" for n, s in keys["spellings"].items()))
        lines.append(f"made-up tokens, {gateway}: {keys['made_up_tokens']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2_000, help="requests in all (bodies fill up the rest)")
    parser.add_argument("--slow", type=int, default=200, help="slow partial connections")
    parser.add_argument("--uploads", type=int, default=300, help="slow and oversize uploads sent at once")
    parser.add_argument("--key-rounds", type=int, default=10, help="times each spelling of the API key is sent")
    parser.add_argument("--tokens", type=int, default=300, help="made-up tokens sent to each gateway")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--uncapped",
        action="store_true",
        help="run the main gateway without the process-wide caps (to see what they bound; expect FAIL on RSS)",
    )
    parser.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/bench_fuzz.json")
    args = parser.parse_args(argv)
    result = run(args.requests, args.slow, args.seed, args.uploads, args.key_rounds, args.tokens, not args.uncapped)
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
        and result["uploads"]["health_probes_failed"] == 0
        and result["uploads"]["rss_bounded"]
    )
    print("PASS" if clean else "FAIL")
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
