"""bench_soak samples what its table says: the RSS column is the gateway process's VmRSS, the
affinity column is that gateway's own index occupancy (``/admin/stats``, admin key and all),
every request is counted (the gateway saw exactly the run's ok + errors), the prefixes really
are unique (the gateway never routed one by affinity), the index fills up to its byte bound
(``--affinity-mb``), not to the far smaller model of the replicas' KV caches that
``replica_cache_tokens: auto`` would apply, and a short run writes its table and JSON; the
verdict (flat RSS over the last half, no errors) is checked on a made-up run.

The live run is the benchmark's own ``main`` for three seconds with a 3 MiB index (a bound
above the KV cache model's that a short run fills), with ``serve_gateway``,
``rss_mb`` and ``affinity_keys`` wrapped to note which process and endpoint they read; the
wrapper also reads the gateway's request counter and stats just before it stops.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import bench_soak as bs
from gateway.routing.affinity import ENTRY_BYTES
from gateway.routing.policies.prefix_settings import PrefixPolicySettings
from gateway.sim.options import SimOptions

MINUTES, SAMPLE_S, CONCURRENCY = 0.05, 0.5, 4  # a 3 s run, a sample every 0.5 s
# 5,616 (key, replica) pairs at 560 bytes: above the ~4,200 the KV cache model would allow, and
# full after ~800 requests (a second or so here)
AFFINITY_MB = 3.0


def gateway_requests(url: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        total += sum(s.value for s in family.samples if s.name == "prefix_gateway_requests_total")
    return total


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], dict[str, Any], str, int]]:
    tmp = tmp_path_factory.mktemp("soak")
    seen: dict[str, Any] = {"gateways": [], "rss_pids": [], "stats_urls": []}
    real = {name: getattr(bs, name) for name in ("serve_gateway", "rss_mb", "affinity_keys")}

    @contextlib.contextmanager
    def serve_gateway(config: dict[str, Any], log_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
        with real["serve_gateway"](config, log_path) as (url, proc):
            gateway = {"url": url, "pid": proc.pid, "config": config}
            seen["gateways"].append(gateway)
            yield url, proc
            gateway["requests"] = gateway_requests(url)
            stats = httpx.get(f"{url}/admin/stats", headers={"Authorization": f"Bearer {bs.ADMIN_KEY}"}, timeout=10)
            gateway["route"] = stats.json()["routes"]["soak"]

    def rss_mb(pid: int) -> float:
        seen["rss_pids"].append(pid)
        return real["rss_mb"](pid)

    def affinity_keys(url: str) -> int | None:
        seen["stats_urls"].append(url)
        return real["affinity_keys"](url)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFIX_GATEWAY_ADMIN_KEY", bs.ADMIN_KEY)  # run() sets it for its gateway: restored after
        mp.setattr(bs, "RESULTS", tmp / "bench_soak.json")
        mp.setattr(bs, "serve_gateway", serve_gateway)
        mp.setattr(bs, "rss_mb", rss_mb)
        mp.setattr(bs, "affinity_keys", affinity_keys)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            args = ["--minutes", str(MINUTES), "--sample", str(SAMPLE_S), "--concurrency", str(CONCURRENCY)]
            args += ["--affinity-mb", str(AFFINITY_MB)]
            code = bs.main(args)
    yield seen, json.loads((tmp / "bench_soak.json").read_text()), out.getvalue(), code


@pytest.mark.slow
def test_rss_is_read_from_the_gateway_process(soak) -> None:
    seen, result, _, _ = soak
    (gateway,) = seen["gateways"]
    assert seen["rss_pids"] and set(seen["rss_pids"]) == {gateway["pid"]}
    assert len(seen["rss_pids"]) == len(result["samples"])
    assert all(s["rss_mb"] > 0 for s in result["samples"])


@pytest.mark.slow
def test_affinity_occupancy_is_the_gateways_own_and_every_prefix_is_new(soak) -> None:
    seen, result, _, _ = soak
    (gateway,) = seen["gateways"]
    assert set(seen["stats_urls"]) == {gateway["url"]}
    assert [(r["name"], r["policy"]) for r in gateway["config"]["routes"]] == [("soak", "prefix")]
    entries = [s["affinity_entries"] for s in result["samples"]]
    assert None not in entries, "a sample missed /admin/stats (admin key or the stats' shape)"
    assert all(e > 0 for e in entries)
    # a prefix no other request shares: no request was ever routed by affinity, each one went to the ring
    assert gateway["route"]["reasons"] == {"ring": result["requests"]}


@pytest.mark.slow
def test_the_index_fills_to_its_byte_bound_not_to_a_model_of_the_replicas_kv_caches(soak) -> None:
    seen, result, _, _ = soak
    (gateway,) = seen["gateways"]
    max_bytes = int(AFFINITY_MB * 1024 * 1024)
    (route,) = gateway["config"]["routes"]
    assert route["policy_settings"] == {"replica_cache_tokens": None, "affinity_max_bytes": max_bytes}
    affinity = gateway["route"]["policy_state"]["affinity"]
    assert affinity["modelled_cache_tokens"] == {}, "a KV cache model caps each replica's share"
    # the byte bound's pairs per replica (AffinityIndex.capacity: the dicts' fixed overhead aside)
    replicas = len(gateway["config"]["replicas"])
    per_replica = (max_bytes - 100 * (2 * replicas + 1)) // ENTRY_BYTES // replicas
    assert affinity["capacity_per_replica"] == per_replica
    # what the default replica_cache_tokens: auto would hold: each simulator's KV cache in keys
    sim, prefix = SimOptions(), PrefixPolicySettings()
    kv_model = replicas * sim.num_gpu_blocks // prefix.stride_for(sim.block_size)
    entries = [s["affinity_entries"] for s in result["samples"]]
    assert max(entries) > kv_model * 1.2, f"the index stopped near the KV cache model's {kv_model}: {entries}"
    assert affinity["entries"] == replicas * per_replica, "the index is full at its byte bound, and no fuller"
    assert max(entries) <= replicas * per_replica


@pytest.mark.slow
def test_every_request_is_counted_and_reached_the_gateway(soak) -> None:
    seen, result, _, _ = soak
    (gateway,) = seen["gateways"]
    assert result["errors"] == 0 and result["error_kinds"] == {}
    assert gateway["requests"] == result["requests"]
    requests = [s["requests"] for s in result["samples"]]
    assert requests == sorted(requests) and requests[-1] <= result["requests"]


@pytest.mark.slow
def test_a_short_run_writes_its_table_and_json(soak) -> None:
    _, result, text, code = soak
    samples = result["samples"]
    assert len(samples) >= MINUTES * 60 / SAMPLE_S - 1
    assert set(samples[0]) == {"t_s", "requests", "rps", "errors", "rss_mb", "affinity_entries"}
    half = [s["rss_mb"] for s in samples[len(samples) // 2 :]]
    assert result["rss_start_mb"] == samples[0]["rss_mb"] and result["rss_end_mb"] == samples[-1]["rss_mb"]
    assert result["rss_last_half_growth_mb"] == round(half[-1] - half[0], 1)
    assert result["rss_last_half_max_minus_min_mb"] == round(max(half) - min(half), 1)
    assert result["settings"] == {
        "minutes": MINUTES,
        "concurrency": CONCURRENCY,
        "sample_s": SAMPLE_S,
        "affinity_mb": AFFINITY_MB,
    }
    lines = text.splitlines()
    assert lines[0].split() == ["t", "(s)", "requests", "req/s", "errors", "RSS", "MB", "affinity", "entries"]
    assert len(lines) == 1 + len(samples) + 2 and lines[-1] == ("PASS" if code == 0 else "FAIL")
    assert f"{result['requests']} requests, 0 errors" in lines[-2]
    assert code == (0 if result["rss_last_half_growth_mb"] <= 10.0 else 1)


def made_up(rss: list[float], errors: int = 0) -> dict[str, Any]:
    samples = [
        {"t_s": i, "requests": 10 * i, "rps": 10.0, "errors": errors, "rss_mb": r, "affinity_entries": 7}
        for i, r in enumerate(rss)
    ]
    half = rss[len(rss) // 2 :]
    return {
        "samples": samples,
        "requests": 10 * len(rss),
        "errors": errors,
        "error_kinds": {"502 b'x'": errors} if errors else {},
        "rss_start_mb": rss[0],
        "rss_end_mb": rss[-1],
        "rss_last_half_growth_mb": round(half[-1] - half[0], 1),
        "rss_last_half_max_minus_min_mb": round(max(half) - min(half), 1),
    }


@pytest.mark.parametrize(
    ("rss", "errors", "flat_mb", "passed"),
    [
        ([100, 130, 140, 141, 142], 0, 10, True),  # grows while the index fills, then flat
        ([100, 130, 140, 141, 142], 0, 1, False),  # +2 MB over the last half, 1 allowed
        ([100, 105, 110, 125, 140], 0, 10, False),  # still growing
        ([100, 130, 140, 141, 142], 1, 10, False),  # flat, but a request failed
    ],
)
def test_the_verdict_wants_flat_rss_over_the_last_half_and_no_errors(
    monkeypatch, capsys, rss: list[float], errors: int, flat_mb: float, passed: bool
) -> None:
    monkeypatch.setattr(bs, "run", lambda *args: made_up(rss, errors))
    monkeypatch.setattr(bs, "RESULTS", Path("/nonexistent/never-written.json"))  # --no-save
    assert bs.main(["--no-save", "--flat-mb", str(flat_mb)]) == (0 if passed else 1)
    assert capsys.readouterr().out.splitlines()[-1] == ("PASS" if passed else "FAIL")


def test_rss_mb_is_the_process_vmrss_in_mib() -> None:
    """Read between two reads of VmRSS that agree: a child just started may still be exec'ing
    (176 KiB forked, 284 KiB a moment later), so a single read before can race it."""

    def vmrss_kib(pid: int) -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))

    proc = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 10.0
        while True:
            before, got, after = vmrss_kib(proc.pid), bs.rss_mb(proc.pid), vmrss_kib(proc.pid)
            if before == after:
                break
            assert time.monotonic() < deadline, "the child's RSS never settled"
        assert got == before / 1024
    finally:
        proc.kill()
        proc.wait()
