"""Every routing policy on the same simulated fleet, per workload and load level, in one run.

    python benchmarks/bench_policies.py --repeat 3          # every row, full samples (~45 min on 2 busy cores)
    python benchmarks/bench_policies.py --quick --repeat 3  # the verdict run in ~20 min (see benchmarks/README.md)
    python benchmarks/bench_policies.py --smoke             # harness check (a few minutes)
    python benchmarks/bench_policies.py --workload agent --load saturated

For each workload (agent, agent_long, agent_toolloop, mooncake_conversation, mooncake_synthetic,
control) and load level
(moderate, saturated): the same pre-built requests are replayed open-loop through a fresh
gateway per policy in front of the same 4 simulated replicas (separate processes; their
prefix caches are flushed before every run, so every policy starts cold), and once more
against the pooled oracle: ONE simulated replica with the whole fleet's KV capacity (4x the
blocks) and its pooled compute, whose hit rate is the upper bound for any router.  For the
agent workload the oracle sits behind a one-replica gateway with the same normalization, so it
sees the same normalized prompts the policies' replicas see.

The Rust SGLang router (``sglang-router``, policy ``cache_aware``) is one more row, in front of
the same replicas with the same requests (``peer_sglang.py``); it is skipped, with the reason
printed, where the package is not installed.

Results: a table per workload and load level with PASS/FAIL per target (issue 8: hit rate vs
the oracle and the SGLang router, TTFT vs the SGLang router at moderate load and the oracle at
saturated load, balance of prefill work), written to ``benchmarks/results/bench_policies.json``
(+ ``.md``) and PNG charts in the same folder.  Policies not registered in this checkout are
listed and skipped; without a gateway at all the client round-robins over the replicas itself
(``client_rr``) so the harness still runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.*` and `gateway.*` importable
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from benchmarks import peer_sglang, report  # noqa: E402
from benchmarks.processes import ManagedProcess, free_port  # noqa: E402
from benchmarks.procstat import cpu_seconds  # noqa: E402
from benchmarks.replay import ReplayResult, id_prefix, median_of_runs, prepare, replay, summarize  # noqa: E402
from benchmarks.workloads import WORKLOAD_NAMES, Workload, build  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
MODEL = "demo-model"
REPLICAS = 4
POLICIES = ("round_robin", "random", "least_loaded", "session", "prefix")
# The rows a default run has: what issue 8's verdicts read (least_loaded for the control, the
# SGLang router, prefix) plus round-robin as context.  ``--policy`` picks others (random, session).
DEFAULT_ROWS = ("round_robin", "least_loaded", "prefix")
SGLANG = peer_sglang.ROW  # the peer router's row: not a gateway policy, a separate process
# --epp: the prefix policy as Envoy's endpoint picker (a real Envoy + ``prefix-gateway epp``,
# bench_epp.py's processes) beside the proxy's prefix row, on the same fleet and requests
EPP = "prefix_epp"
EPP_ENVOY_CONCURRENCY = 2
LOAD_AWARE = report.LOAD_AWARE  # the control workload's reference row
CONTROL = "control"
LEVELS = ("moderate", "saturated")

# The simulated fleet, the same hardware for every workload: one replica prefills 30k tokens
# per simulated second (an 8B-class model on one modern GPU), takes 40 ms per decode step and
# holds 16,384 blocks of 16 tokens = 262k tokens of KV.  ``time_scale`` (wall seconds per
# simulated second) is set per workload by ``time_scale_for``: ~0.1 for the Mooncake replays
# (a decode step = 4 ms of wall time), more for workloads with short prompts.
SIM: dict[str, Any] = {
    "model": MODEL,
    "time_scale": 0.1,  # overridden per workload
    "block_size": 16,
    "num_gpu_blocks": 16_384,
    "max_num_seqs": 128,
    "max_num_batched_tokens": 8192,
    "max_model_len": 131_072,
    "prefill_tokens_per_s": 30_000.0,
    "decode_ms_per_token": 40.0,
    "enable_admin": True,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}
# The pooled oracle: one replica with the fleet's KV blocks and the fleet's pooled compute.
ORACLE_SIM: dict[str, Any] = {
    "num_gpu_blocks": SIM["num_gpu_blocks"] * REPLICAS,
    "prefill_tokens_per_s": SIM["prefill_tokens_per_s"] * REPLICAS,
    "max_num_seqs": SIM["max_num_seqs"] * REPLICAS,
    "max_num_batched_tokens": SIM["max_num_batched_tokens"] * REPLICAS,
}

# Offered load per level, as a multiple of the fleet's prefill capacity for the workload's
# prompt tokens *as if nothing were cached*.  Chosen per workload and level from round-robin's
# measured hit rate on that level's sample (agent ~0 %: without normalization the timestamp on
# top defeats every cache; conversation ~9 % / ~7 %; synthetic ~25 % / ~13 %: the saturated
# sample holds twice the sessions, so less of it fits in the caches; control 0 %) so that
# round-robin's uncached work is ~60 % of the fleet's capacity at "moderate" and ~125 % at
# "saturated".
LOADS: dict[str, dict[str, float]] = {
    "agent": {"moderate": 0.6, "saturated": 1.25},
    # round-robin hits ~87 % here (every replica soon holds the 4 tenants' 6k-12k-token heads):
    # its uncached work is then ~0.6x / ~1.2x of capacity
    "agent_long": {"moderate": 4.5, "saturated": 9.0},
    "agent_toolloop": {"moderate": 0.6, "saturated": 1.25},  # round-robin ~0 %: the header on top
    "mooncake_conversation": {"moderate": 0.65, "saturated": 1.35},
    "mooncake_synthetic": {"moderate": 0.8, "saturated": 1.45},
    # round-robin hits ~42 % / ~49 % (the system prompt and the popular documents are everywhere)
    "rag": {"moderate": 1.05, "saturated": 2.45},
    "control": {"moderate": 0.6, "saturated": 1.25},
    # two tenants (issue 26): each burst shares one document, so cache-blind placement still
    # hits ~77 % (least_loaded on the virtual clock); the same multiples as agent_long
    "tenants": {"moderate": 4.5, "saturated": 9.0},
}
MODERATE_RATE_RPS = 55.0  # wall-clock arrival rate of the moderate level (sets each workload's time_scale)
ADMIN_KEY_ENV = "PREFIX_GATEWAY_ADMIN_KEY"
ADMIN_KEY = secrets.token_hex(16)  # per benchmark process, for the gateways it starts
SMOKE_SIZE = 0.3
# --quick: the verdict run cut to fit ~20 minutes with --repeat 3 on 2 busy cores: half-size
# samples (half the arrivals' span per cell) and only the rows the verdicts read.
QUICK_SIZE = 0.5
# The saturated level replays a 2x larger sample of the same workload (more conversations /
# sessions of the same shape; for the traces a superset of the moderate sample): at the same
# wall-clock rate its arrivals last twice as long, so queues have time to build.
LEVEL_SIZE = {"moderate": 1.0, "saturated": 2.0}
DEADLINE_FACTOR = 1.6  # hard deadline = arrivals' span x this + DEADLINE_SLACK_S
DEADLINE_SLACK_S = 4.0


# -- processes --------------------------------------------------------------------------------


def http_json(url: str, data: bytes | None = None, timeout: float = 5.0) -> Any:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    if data is not None:
        req.add_header("content-type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def poll(url: str, deadline_s: float, what: str) -> None:
    """Wait until ``url`` answers 200 (or raise with ``what``)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready at {url} within {deadline_s:.0f} s")
        time.sleep(0.1)


def gateway_available() -> bool:
    return (ROOT / "gateway" / "cli.py").is_file()


def registered_policies() -> list[str]:
    """Policy names the gateway in this checkout can serve (empty without a gateway)."""
    if not gateway_available():
        return []
    try:
        from gateway.routing import registry
    except Exception:  # a half-landed checkout: run what exists
        return []
    return list(registry.POLICIES)


class GatewayProcess(ManagedProcess):
    """One ``prefix-gateway serve --config FILE`` process with a generated config."""


def gateway_config(replicas: Sequence[tuple[str, str]], variant: Variant, port: int) -> dict[str, Any]:
    """The whole gateway config of one run: one route, one policy, quiet logs."""
    route: dict[str, Any] = {"name": "bench", "policy": variant.policy, "normalize": {"mode": variant.normalize}}
    # "health.x=v" in a variant's settings sets the gateway's health section (e.g. slow-replica
    # detection); every other key is a policy setting
    health = {k.removeprefix("health."): v for k, v in variant.settings if k.startswith("health.")}
    policy_settings = {k: v for k, v in variant.settings if not k.startswith("health.")}
    if policy_settings:
        route["policy_settings"] = policy_settings
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port},
        "logging": {"level": "warning", "access_log": False, "summary_interval_s": 0},
        "replicas": [{"name": name, "url": url} for name, url in replicas],
        "routes": [route],
    }
    if health:
        config["health"] = health
    return config


def start_gateway(
    variant: Variant,
    replicas: Sequence[tuple[str, str]],
    workdir: Path,
    extra_config: dict[str, Any] | None = None,
) -> GatewayProcess:
    """Start (not wait for) a gateway; ``extra_config`` adds top-level sections (``state:`` for the fleet bench)."""
    name = variant.name
    port = free_port()
    config = workdir / f"gateway-{name}.yaml"
    settings = {**gateway_config(replicas, variant, port), **(extra_config or {})}
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    log_path = workdir / f"gateway-{name}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env[ADMIN_KEY_ENV] = ADMIN_KEY  # read-only use: GET /admin/stats after each run
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(ROOT),
        )
    return GatewayProcess(name, f"http://127.0.0.1:{port}", proc, log_path)


@dataclass
class EppRow(ManagedProcess):
    """Envoy + ``prefix-gateway epp`` as one row: ``url`` is Envoy's, ``process`` the picker's;
    ``admin_url`` the picker's HTTP app (``/admin/stats``); both stop with the ExitStack that started them."""

    admin_url: str = ""
    envoy_pid: int = 0

    def stop(self) -> None:
        """Stopped by the ExitStack of :func:`gateways` (Envoy first, then the picker)."""


def start_epp(
    variant: Variant, replicas: Sequence[tuple[str, str]], workdir: Path, stack: contextlib.ExitStack
) -> EppRow:
    """The picker with this row's gateway config, and a fail-closed Envoy in front of the same replicas."""
    from benchmarks.bench_epp import envoy_process, picker_process, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    config = gateway_config(replicas, variant, 0)
    picker = stack.enter_context(picker_process(config, workdir, f"picker-{variant.name}", {ADMIN_KEY_ENV: ADMIN_KEY}))
    envoy = envoy_process([url for _, url in replicas], picker.grpc_port, workdir, EPP_ENVOY_CONCURRENCY)
    url, envoy_pid = stack.enter_context(envoy)
    return EppRow(variant.name, url, picker.process, picker.log_path, admin_url=picker.admin_url, envoy_pid=envoy_pid)


@dataclass(frozen=True)
class Variant:
    """One row of the table: a policy behind a gateway with a normalization mode (and settings)."""

    name: str
    policy: str
    normalize: str
    settings: tuple[tuple[str, Any], ...] = ()


def parse_variant(text: str) -> tuple[str, str, tuple[tuple[str, Any], ...]]:
    """``NAME:POLICY[:key=value,...]`` → an extra table row, e.g. ``strict:prefix:bound_extra=0``.

    Values are YAML scalars (``0``, ``1.5``, ``null``, ``true``).
    """
    parts = text.split(":", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise argparse.ArgumentTypeError(f"expected NAME:POLICY[:key=value,...], got {text!r}")
    settings = []
    for item in filter(None, (parts[2] if len(parts) == 3 else "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected key=value in {text!r}, got {item!r}")
        settings.append((key.strip(), yaml.safe_load(value)))
    return parts[0], parts[1], tuple(settings)


@contextlib.contextmanager
def gateways(
    specs: Sequence[tuple[Variant, Sequence[tuple[str, str]]]], workdir: Path, failed: dict[str, str]
) -> Iterator[dict[str, GatewayProcess | peer_sglang.SGLangRouter]]:
    """Start several gateways (and the SGLang router's row) at once and wait until they are ready.

    A gateway that does not come up is left out of the yielded mapping and its error (with the
    tail of its log) is stored in ``failed``: one broken policy must not stop the benchmark.
    """
    started: dict[str, GatewayProcess | peer_sglang.SGLangRouter] = {}
    behind_envoy: list[tuple[Variant, Sequence[tuple[str, str]]]] = []
    stack = contextlib.ExitStack()
    try:
        for variant, replicas in specs:
            if variant.name == EPP:
                behind_envoy.append((variant, replicas))
            elif variant.policy == SGLANG:
                started[variant.name] = peer_sglang.start([url for _, url in replicas], workdir, variant.name)
            else:
                started[variant.name] = start_gateway(variant, replicas, workdir)
        ready: dict[str, GatewayProcess | peer_sglang.SGLangRouter] = {}
        for name, gw in started.items():
            try:
                if isinstance(gw, peer_sglang.SGLangRouter):
                    peer_sglang.wait_ready(gw, MODEL, 60)
                else:
                    poll(gw.url + "/ready", 60, f"gateway {gw.name}")
                warm_up(gw.url)
                ready[name] = gw
            except RuntimeError as exc:
                gw.stop()
                tail = gw.log_path.read_text(errors="replace")[-1500:]
                failed[name] = f"{exc}; log tail: {tail}"
                print(f"  {name:<16} FAILED TO START: {exc}")
        for variant, replicas in behind_envoy:
            try:
                ready[variant.name] = start_epp(variant, replicas, workdir, stack)
                warm_up(ready[variant.name].url)
            except RuntimeError as exc:
                failed[variant.name] = str(exc)
                print(f"  {variant.name:<16} FAILED TO START: {exc}")
        yield ready
    finally:
        for gw in started.values():
            gw.stop()
        stack.close()


def warm_up(url: str) -> None:
    """One tiny completion and one tiny chat request through a router before it is measured.

    Every row then starts warm, as the SGLang row does after its readiness poll: a gateway
    loads its tokenizer and chat template on the first request that needs them (a one-time
    cost of a few hundred ms on a busy machine), which must not land on the first measured
    requests.  The replicas' caches are flushed after this, before every run.
    """
    for path, body in (
        ("/v1/completions", {"model": MODEL, "prompt": "warm up", "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1},
        ),
    ):
        # a router that cannot serve shows in the run itself
        with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
            http_json(url + path, data=json.dumps(body).encode(), timeout=30)


def gateway_stats(url: str) -> dict[str, Any] | None:
    """The gateway's own account of a run (``GET /admin/stats``): routing reasons, per-replica counts."""
    req = urllib.request.Request(url + "/admin/stats", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            stats = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    route = next(iter((stats.get("routes") or {}).values()), {})
    return {
        "reasons": route.get("reasons"),
        "requests_per_replica": {name: r.get("requests") for name, r in (route.get("replicas") or {}).items()},
        # what the gateway expected cached against what the responses said (its own accounting)
        "hit_rate_predicted": route.get("hit_rate_predicted"),
        "hit_rate_reported": route.get("hit_rate_reported"),
        # the prediction's own numerator and denominator, to pool several gateways' (bench_fleet)
        "predicted_cached_tokens": route.get("predicted_cached_tokens"),
        "predicted_prompt_tokens": route.get("predicted_prompt_tokens"),
    }


def sim_states(urls: Sequence[str]) -> list[dict[str, Any]]:
    return [http_json(u + "/sim/state") for u in urls]


def reset_sims(urls: Sequence[str], deadline_s: float = 60.0) -> None:
    """Wait until every replica is idle, then flush its prefix cache: the next run starts cold."""
    deadline = time.monotonic() + deadline_s
    while True:
        states = sim_states(urls)
        if all(s["running"] == 0 and s["waiting"] == 0 for s in states):
            break
        if time.monotonic() > deadline:
            break  # the restart below aborts leftovers (cancelled requests the engine still holds)
        time.sleep(0.1)
    for url in urls:
        http_json(url + "/sim/restart", data=b"{}")
    leftover = [s["num_cached_blocks"] for s in sim_states(urls)]
    if any(leftover):
        raise RuntimeError(f"prefix caches not empty after restart: {leftover}")


def engine_hit_rate(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]]) -> float | None:
    """Hit rate from the engines' own counters over the run (cross-check of the responses)."""
    queries = sum(a["prefix_cache_queries"] - b["prefix_cache_queries"] for a, b in zip(after, before, strict=True))
    hits = sum(a["prefix_cache_hits"] - b["prefix_cache_hits"] for a, b in zip(after, before, strict=True))
    return hits / queries if queries else None


def prefill_work(
    before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]], names: Sequence[str]
) -> dict[str, Any]:
    """Uncached prompt tokens (prefill work) per replica over the run, from the engines' counters.

    Balance is judged on work, not on momentary in-flight counts (issue 8): max/mean over the
    replicas of (prompt tokens - cached tokens), idle replicas included.
    """
    work = {
        name: (a["prefix_cache_queries"] - b["prefix_cache_queries"])
        - (a["prefix_cache_hits"] - b["prefix_cache_hits"])
        for name, a, b in zip(names, after, before, strict=True)
    }
    mean = sum(work.values()) / len(work) if work else 0.0
    return {"per_replica": work, "max_over_mean": max(work.values()) / mean if mean > 0 else None}


def probe_id_prefixes(urls: Sequence[str], names: Sequence[str]) -> dict[str, str]:
    """Each replica's response-id prefix (two tiny completions sent to it directly).

    The SGLang router does not say which replica served a request; the replicas' response ids
    do.  Empty when the ids carry no distinct per-replica prefix (then that row's in-flight
    statistics lack the replica; its prefill-work balance, from the engines, does not).
    """
    body = json.dumps({"model": MODEL, "prompt": "probe", "max_tokens": 1}).encode()
    out: dict[str, str] = {}
    for url, name in zip(urls, names, strict=True):
        try:
            ids = [http_json(url + "/v1/completions", data=body).get("id") for _ in range(2)]
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            return {}
        prefix = id_prefix([i for i in ids if isinstance(i, str)])
        if prefix is None or prefix in out:
            return {}
        out[prefix] = name
    return out


# -- one run ----------------------------------------------------------------------------------


def run_once(
    wire: Sequence[Any],
    target: str | Sequence[str],
    sims: Sequence[str],
    replica_names: Sequence[str],
    deadline_s: float,
    via_gateway: bool,
    id_prefixes: dict[str, str] | None = None,
    replayer: Callable[..., Awaitable[ReplayResult]] = replay,
) -> dict[str, Any]:
    """One replay on emptied caches, summarized; ``replayer`` wraps ``replay`` to act during the run."""
    reset_sims(sims)
    before = sim_states(sims)
    targets = [target] if isinstance(target, str) else list(target)
    result = asyncio.run(
        replayer(
            wire,
            targets,
            deadline_s=deadline_s,
            replica_names=replica_names,
            via_gateway=via_gateway,
            id_prefixes=id_prefixes,
        )
    )
    # let the engines finish what was sent (cut requests were aborted by the disconnect)
    reset_deadline = time.monotonic() + 10
    while time.monotonic() < reset_deadline:
        if all(s["running"] == 0 and s["waiting"] == 0 for s in sim_states(sims)):
            break
        time.sleep(0.1)
    after = sim_states(sims)
    summary = summarize(result).to_dict()
    summary["engine_hit_rate"] = engine_hit_rate(before, after)
    summary["prefill_work"] = prefill_work(before, after, replica_names)
    summary["deadline_s"] = deadline_s
    return summary


def fmt_short(name: str, s: dict[str, Any]) -> str:
    hit = s.get("hit_rate")
    t = s.get("ttft_ms", {})
    return (
        f"  {name:<16} hit {hit if hit is None else f'{hit:6.1%}'}  TTFT p50 {t.get('p50') or 0:7.0f} "
        f"p90 {t.get('p90') or 0:7.0f} ms  ok {s['ok']}/{s['requests']}"
        + (f" cut {s['unfinished']}" if s["unfinished"] else "")
        + (f" errors {s['errors']} {s['error_samples'][:1]}" if s["errors"] else "")
        + (f"  predicted {pred:.1%}" if isinstance(pred := s.get("hit_rate_predicted"), int | float) else "")
        + (f"  (client lag {s['max_dispatch_lag_ms']:.0f} ms)" if s["max_dispatch_lag_ms"] > 20 else "")
        + (f"  reasons {reasons}" if len(reasons := (s.get("gateway") or {}).get("reasons") or {}) > 1 else "")
    )


# -- the benchmark ----------------------------------------------------------------------------


def variants_for(workload: Workload, plan: Plan) -> list[Variant]:
    """Every policy with the workload's normalization; with ``--norm-off-row``, for a workload that
    needs normalization, also the prefix policy with it turned off, to show what the volatile
    header costs (the SGLang and round-robin rows, which never normalize, show it too); then the
    extra ``--variant`` rows."""
    policies = plan.policies
    if plan.lean:  # only what the verdicts read (and round-robin as context)
        keep = {LOAD_AWARE} if workload.name == CONTROL else {SGLANG}
        policies = [p for p in policies if p not in {LOAD_AWARE, SGLANG} - keep]
    # the peer router has no normalization: it gets the prompts as the application sent them
    variants = [Variant(p, p, "off" if p == SGLANG else workload.normalize) for p in policies]
    if plan.norm_off_row and workload.normalize != "off" and "prefix" in policies:
        variants.append(Variant("prefix_norm_off", "prefix", "off"))
    if plan.epp and "prefix" in policies:
        variants.append(Variant(EPP, "prefix", workload.normalize))
    variants += [Variant(name, policy, workload.normalize, settings) for name, policy, settings in plan.extra]
    return variants


def time_scale_for(workload: Workload, sim: dict[str, Any], replicas: int) -> float:
    """Wall seconds per simulated second for this workload (2 significant digits).

    The simulated hardware is the same for every workload; only the clock compression
    differs, chosen so that the moderate level arrives at about ``MODERATE_RATE_RPS`` requests
    per wall second: workloads with short prompts (agent, control) need a slower clock than
    the Mooncake replays, or the client, gateway and simulators would run out of CPU before
    the simulated GPUs run out of prefill capacity.
    """
    capacity_sim = replicas * sim["prefill_tokens_per_s"]  # tokens per simulated second
    util = LOADS[workload.name]["moderate"]
    tokens_per_request = workload.total_prompt_tokens / max(len(workload.requests), 1)
    # moderate rate (per simulated second) = util x capacity / tokens per request; scale it to wall time
    sim_rate = util * capacity_sim / tokens_per_request
    time_scale = sim_rate / MODERATE_RATE_RPS
    return float(f"{min(max(time_scale, 0.01), 1.0):.2g}")


def time_factor_for(
    workload: Workload, utilization: float, time_scale: float, sim: dict[str, Any], replicas: int
) -> float:
    """Wall seconds per workload second so that cache-blind prefill demand = utilization x capacity.

    Fleet capacity in wall time is ``replicas x prefill_tokens_per_s / time_scale`` tokens/s.
    """
    capacity = replicas * sim["prefill_tokens_per_s"] / time_scale
    demand_at_1x = workload.total_prompt_tokens / workload.duration
    return demand_at_1x / (utilization * capacity)


@dataclass(frozen=True)
class Plan:
    """What to run, decided once from the command line."""

    levels: list[str]
    policies: list[str]
    direct: bool
    workdir: Path
    extra: tuple[tuple[str, str, tuple[tuple[str, Any], ...]], ...] = ()  # --variant rows
    repeat: int = 1  # runs per cell; the table shows their medians
    norm_off_row: bool = False  # also prefix with normalization off where the workload needs it
    lean: bool = False  # --quick: least_loaded only on the control, sglang everywhere but there
    epp: bool = False  # also the prefix policy through Envoy + the picker (row EPP)


def run_level(
    wl: Workload,
    level: str,
    time_scale: float,
    fleet: list[str],
    oracle_url: str,
    plan: Plan,
    id_prefixes: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Every variant, then the oracle, on one workload at one load level."""
    names = [f"r{i}" for i in range(len(fleet))]
    util = LOADS[wl.name][level]
    factor = time_factor_for(wl, util, time_scale, SIM, REPLICAS)
    wire = prepare(wl.requests, MODEL, factor)
    # the same traffic without its volatile header, for the oracle only (same arrival times)
    reference_wire = prepare(wl.reference, MODEL, factor) if wl.reference else None
    span = wire[-1].at if wire else 0.0
    deadline = span * DEADLINE_FACTOR + DEADLINE_SLACK_S
    rate = len(wire) / max(span, 1e-9)
    print(
        f"-- {wl.name} @ {level}: {util}x capacity, {span:.1f} s of arrivals ({rate:.0f} req/s), "
        f"deadline {deadline:.0f} s"
    )
    ldata: dict[str, Any] = {
        "utilization": util,
        "time_scale": time_scale,
        "time_factor": factor,
        "duration_s": span,
        "rate_rps": rate,
        "runs": {},
    }
    if plan.direct:
        s = run_once(wire, fleet, fleet, names, deadline, via_gateway=False)
        ldata["runs"]["client_rr"] = s
        print(fmt_short("client_rr", s))
        s = run_once(wire, oracle_url, [oracle_url], ["oracle"], deadline, via_gateway=False)
        ldata["oracle"] = s
        print(fmt_short("oracle", s))
        return ldata
    variants = variants_for(wl, plan)
    replicas = list(zip(names, fleet, strict=True))
    specs = [(v, replicas) for v in variants]
    # The oracle must see the prompts the policy under test sends: for a workload that needs
    # normalization it sits behind a one-replica gateway that normalizes (the prefix policy).
    oracle_via_gateway = wl.normalize != "off" and "prefix" in plan.policies
    if oracle_via_gateway:
        specs.append((Variant("oracle", "prefix", wl.normalize), [("oracle", oracle_url)]))
    failed: dict[str, str] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    # Every repetition starts fresh gateways (cold affinity indexes, like the flushed replica
    # caches) and goes round every variant in turn, so a slow moment on the machine hits one
    # run of each variant rather than every run of one.
    for rep in range(plan.repeat):
        tag = f" [{rep + 1}/{plan.repeat}]" if plan.repeat > 1 else ""
        with gateways(specs, plan.workdir, failed) as gws:
            for v in variants:
                if v.name in failed:
                    continue
                gw = gws[v.name]
                # the peer router names no replica: its responses are attributed by their ids
                # (through Envoy too, should a response lack the picker's replica header)
                ids = id_prefixes if v.policy == SGLANG or isinstance(gw, EppRow) else None
                pids = [gw.process.pid, *([gw.envoy_pid] if isinstance(gw, EppRow) else [])]
                cpu0 = sum(cpu_seconds(pid) for pid in pids)
                s = run_once(wire, gw.url, fleet, names, deadline, via_gateway=True, id_prefixes=ids)
                # the router's own CPU per request (Envoy's and the picker's for the EPP row): on a
                # shared machine it decides how much of the CPU a router needs, hence how its
                # latency suffers from the neighbours
                s["router_cpu_ms_per_request"] = (sum(cpu_seconds(pid) for pid in pids) - cpu0) * 1000 / len(wire)
                s["gateway"] = gateway_stats(gw.admin_url if isinstance(gw, EppRow) else gw.url)
                s["hit_rate_predicted"] = (s["gateway"] or {}).get("hit_rate_predicted")  # a median over repeats
                runs.setdefault(v.name, []).append(s)
                print(fmt_short(v.name, s) + tag)
            via = oracle_via_gateway and "oracle" in gws
            target = gws["oracle"].url if via else oracle_url
            s = run_once(wire, target, [oracle_url], ["oracle"], deadline, via_gateway=via)
            runs.setdefault("oracle", []).append(s)
            print(fmt_short("oracle", s) + tag)
            if reference_wire:
                s = run_once(reference_wire, oracle_url, [oracle_url], ["oracle"], deadline, via_gateway=False)
                runs.setdefault(report.REFERENCE_ORACLE, []).append(s)
                print(fmt_short("oracle, no header", s) + tag)
    for v in variants:
        if v.name not in runs:
            ldata["runs"][v.name] = {"policy": v.policy, "normalize": v.normalize, "error": failed.get(v.name)}
            continue
        ldata["runs"][v.name] = _merged(runs[v.name])
        ldata["runs"][v.name].update(policy=v.policy, normalize=v.normalize)
        if v.settings:
            ldata["runs"][v.name]["policy_settings"] = dict(v.settings)
    ldata["oracle"] = _merged(runs["oracle"])
    epp_row, proxy_row = ldata["runs"].get(EPP) or {}, ldata["runs"].get("prefix") or {}
    if isinstance(epp_row.get("hit_rate"), float) and isinstance(proxy_row.get("hit_rate"), float):
        # issue 24: the picker's hit rate within 0.5 points of the proxy's (medians of --repeat)
        points = round((epp_row["hit_rate"] - proxy_row["hit_rate"]) * 100, 2)
        ldata["epp_vs_proxy_hit_points"] = points
        print(f"  {EPP} vs prefix (proxy): {points:+.2f} hit-rate points (target: within 0.5)")
    if report.REFERENCE_ORACLE in runs:
        ldata[report.REFERENCE_ORACLE] = _merged(runs[report.REFERENCE_ORACLE])
    return ldata


def _merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from its repetitions: medians (see ``median_of_runs``), every run kept beside them."""
    if len(runs) == 1:
        return runs[0]
    merged = median_of_runs(runs)
    merged["gateway"] = runs[0].get("gateway")  # decisions by reason: one run's, as in a single run
    merged["repeats"] = runs
    return merged


def run_workload(by_level: dict[str, Workload], plan: Plan) -> dict[str, Any]:
    """Fresh simulators (this workload's clock), then every load level."""
    from gateway.sim.launcher import run_replicas

    wl = next(iter(by_level.values()))
    time_scale = time_scale_for(wl, SIM, REPLICAS)
    per_replica = [{} for _ in range(REPLICAS)] + [ORACLE_SIM]
    t0 = time.monotonic()
    log_dir = plan.workdir / f"sims-{wl.name}"
    sim = {**SIM, "time_scale": time_scale}
    wres: dict[str, Any] = {"description": wl.description, "summary": wl.summary(), "time_scale": time_scale}
    wres["levels"] = {}
    with run_replicas(REPLICAS + 1, per_replica=per_replica, log_dir=log_dir, **sim) as urls:
        print(f"   simulators up in {time.monotonic() - t0:.1f} s (time_scale {time_scale})")
        id_prefixes = probe_id_prefixes(urls[:REPLICAS], [f"r{i}" for i in range(REPLICAS)])
        for level, level_wl in by_level.items():
            ldata = run_level(level_wl, level, time_scale, urls[:REPLICAS], urls[REPLICAS], plan, id_prefixes)
            ldata["workload"] = {k: v for k, v in level_wl.summary().items() if k != "endpoint"}
            wres["levels"][level] = ldata
    verdicts = report.evaluate(wl.name, wres["levels"], control=wl.name == CONTROL)
    wres["targets"] = report.verdicts_to_json(verdicts)
    return wres


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="half-size samples and only the rows the verdicts read (least_loaded on the control only, "
        "sglang not on the control): with --repeat 3 about 20 minutes",
    )
    parser.add_argument("--smoke", action="store_true", help="smaller samples, saturated level only (harness check)")
    parser.add_argument("--workload", action="append", choices=WORKLOAD_NAMES, help="repeatable; default: all")
    parser.add_argument("--load", action="append", choices=LEVELS, help="repeatable; default: both")
    parser.add_argument(
        "--policy",
        action="append",
        help=f"repeatable; default: {', '.join(DEFAULT_ROWS)} and {SGLANG} (also: random, session)",
    )
    parser.add_argument("--size", type=float, default=None, help="workload size factor (default 1, quick 0.3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--variant",
        action="append",
        type=parse_variant,
        default=[],
        metavar="NAME:POLICY[:k=v,...]",
        help="extra row: a policy with settings, e.g. strict:prefix:bound_extra=0; health.KEY=V sets the "
        "gateway's health section, e.g. noslow:prefix:health.slow_ttft_factor=0 (repeatable)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per cell; the table and verdicts use their medians (default 1)"
    )
    parser.add_argument(
        "--norm-off-row",
        action="store_true",
        help="also the prefix policy with normalization off, on workloads that need normalization",
    )
    parser.add_argument(
        "--epp",
        action="store_true",
        help=f"also row {EPP}: the prefix policy as Envoy's endpoint picker (needs the envoy binary and the "
        "[epp] extra), with its hit rate against the proxy's prefix row",
    )
    parser.add_argument("--no-gateway", action="store_true", help="client-side round-robin only (harness check)")
    args = parser.parse_args(argv)

    t_start = time.monotonic()
    workloads = args.workload or list(WORKLOAD_NAMES)
    levels = args.load or (["saturated"] if args.smoke else list(LEVELS))
    default_size = SMOKE_SIZE if args.smoke else QUICK_SIZE if args.quick else 1.0
    size = args.size if args.size is not None else default_size
    available = [] if args.no_gateway else registered_policies()
    sglang_missing = peer_sglang.unavailable_reason()
    if available and not sglang_missing:
        available.append(SGLANG)
    wanted = args.policy or [*DEFAULT_ROWS, SGLANG]
    policies = [p for p in wanted if p in available]
    missing = [p for p in wanted if p not in available]
    direct = not [p for p in policies if p != SGLANG]
    if direct:
        policies = ["client_rr"]
    mode = "direct to the replicas, client-side round-robin (no gateway)" if direct else "through the gateway"
    print(f"policies: {', '.join(policies)}" + (f"; missing (skipped): {', '.join(missing)}" if missing else ""))
    if SGLANG in missing and sglang_missing:
        print(f"row {SGLANG!r} skipped: {sglang_missing}")

    results: dict[str, Any] = {
        "meta": {
            "command": " ".join(["python", "benchmarks/bench_policies.py", *(argv or sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "loadavg_start": [round(x, 1) for x in os.getloadavg()],  # the neighbours on a shared machine
            "python": platform.python_version(),
            "git": _git_rev(),
            "mode": mode,
            "replicas": REPLICAS,
            "sim": {k: SIM[k] for k in SIM if k not in ("enable_admin", "disable_uvicorn_access_log", "model")},
            "oracle_blocks": ORACLE_SIM["num_gpu_blocks"],
            "sglang_router": _version("sglang-router"),
            "tokenizers": _tokenizers(),
            "loads": {w: LOADS[w] for w in workloads},
            "size": size,
            "seed": args.seed,
            "repeat": max(1, args.repeat),
            "quick": bool(args.quick),
            "deadline": f"arrival span x {DEADLINE_FACTOR} + {DEADLINE_SLACK_S} s",
        },
        "missing_policies": missing,
        "skipped_reasons": {SGLANG: sglang_missing} if SGLANG in missing and sglang_missing else {},
        "workloads": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench-policies-") as tmp:
        plan = Plan(
            levels,
            policies,
            direct,
            Path(tmp),
            tuple(args.variant),
            max(1, args.repeat),
            args.norm_off_row,
            lean=args.quick and not args.policy,
            epp=args.epp,
        )
        for wname in workloads:
            t_build = time.monotonic()
            by_level: dict[str, Workload] = {}
            for level in levels:
                level_size = size * LEVEL_SIZE[level]
                same = next((w for w in by_level.values() if w.meta.get("size") == level_size), None)
                by_level[level] = same or build(wname, size=level_size, seed=args.seed)
                by_level[level].meta["size"] = level_size
            sizes = ", ".join(
                f"{lv}: {len(w.requests)} requests / {w.total_prompt_tokens / 1e6:.2f} M prompt tokens"
                for lv, w in by_level.items()
            )
            print(f"\n== {wname} ({sizes}; built in {time.monotonic() - t_build:.1f} s)")
            results["workloads"][wname] = run_workload(by_level, plan)
            _save(results, args.out)  # keep partial results if a later workload fails

    results["meta"]["elapsed_s"] = round(time.monotonic() - t_start, 1)
    results["meta"]["loadavg_end"] = [round(x, 1) for x in os.getloadavg()]
    _save(results, args.out)
    text = report.render_text(results)
    print("\n" + text)
    (args.out / "bench_policies.md").write_text(text + "\n")
    for path in report.charts(results, args.out):
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    print(f"total {results['meta']['elapsed_s']:.0f} s")
    return 0


def _save(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "bench_policies.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=float))
    tmp.replace(out / "bench_policies.json")


def _tokenizers() -> dict[str, str | None]:
    """The replicas' own tokenizer and the gateway's setting: misalignment is part of the run."""
    out: dict[str, str | None] = {"sim": None, "gateway": None}
    with contextlib.suppress(Exception):
        from gateway.sim.options import SimOptions

        out["sim"] = SimOptions().tokenizer
    with contextlib.suppress(Exception):
        from gateway.prefix.settings import PrefixSettings

        out["gateway"] = PrefixSettings().tokenizer
    return out


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_rev() -> str | None:
    """HEAD, marked ``+dirty`` when tracked files differ (the run used the working tree)."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        status = ["git", "status", "--porcelain", "--untracked-files=no"]
        dirty = subprocess.run(status, cwd=ROOT, capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())
