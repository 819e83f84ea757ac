"""Open-loop replay of a workload against a gateway or simulated replicas, and its summary.

Open loop: every request is sent at its scheduled time whether or not earlier ones have
finished, so a slow policy builds a queue instead of slowing the arrivals down (a closed
loop would hide saturation).  Bounded in count (the request list) and in time (a hard
deadline after which unfinished requests are cancelled and reported, never dropped silently).

Measured client-side, per request: TTFT (request sent -> first chunk with non-empty content,
streaming with ``stream_options.include_usage``), end-to-end time, the usage of the final
chunk (``cached_tokens`` missing = unknown, not 0) and the replica that served it (the
gateway's ``x-prefix-gateway-replica`` header, or the replica the client itself picked in
direct mode).  Per-replica in-flight load is reconstructed afterwards from the exact
[sent, done] intervals, so measuring it costs nothing during the run.

Prompts are serialized to bytes before the clock starts; during the run the client only
sends bytes and parses a handful of small SSE chunks per request.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np

from benchmarks.workloads import TENANT_HEADER, BenchRequest

REPLICA_HEADER = "x-prefix-gateway-replica"
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True, slots=True)
class WireRequest:
    """A request ready to send: when (seconds after start), where (path) and what (bytes)."""

    at: float
    path: str
    body: bytes
    headers: dict[str, str]
    prompt_tokens: int


def wire_body(req: BenchRequest, model: str) -> dict[str, Any]:
    """The JSON body every row receives for ``req``: a stream of exactly ``max_tokens`` tokens."""
    return {
        "model": model,
        **req.body,
        "max_tokens": req.max_tokens,
        "ignore_eos": True,  # vLLM extension: force exactly max_tokens
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def prepare(
    requests: Sequence[BenchRequest],
    model: str,
    time_factor: float,
    session_header: str = "x-session-id",
) -> list[WireRequest]:
    """Serialize every request once; ``time_factor`` maps workload seconds to real seconds."""
    if not requests:
        return []
    t0 = requests[0].t
    wire = []
    for req in requests:
        body = wire_body(req, model)
        headers = {"content-type": "application/json"}
        if req.session:
            headers[session_header] = req.session
        if req.tenant:
            headers[TENANT_HEADER] = req.tenant
        wire.append(
            WireRequest(
                at=(req.t - t0) * time_factor,
                path=PATHS[req.endpoint],
                body=json.dumps(body, separators=(",", ":")).encode(),
                headers=headers,
                prompt_tokens=req.prompt_tokens,
            )
        )
    return wire


@dataclass(slots=True)
class Outcome:
    """What happened to one request; times are seconds since the replay started."""

    index: int
    scheduled: float
    sent: float = math.nan
    first_token: float | None = None
    done: float | None = None
    status: int | None = None
    replica: str | None = None
    sent_to: str | None = None  # the base URL the client sent it to (which gateway, with several)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.done is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


@dataclass(slots=True)
class ReplayResult:
    outcomes: list[Outcome]
    started_at: float  # wall clock (time.time()) of t=0
    ended: float  # seconds after start when the replay stopped (all done or deadline)
    deadline_hit: bool
    replicas: list[str]


def _content_of(chunk: dict[str, Any]) -> str | None:
    choices = chunk.get("choices") or ()
    for choice in choices:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            return text
    return None


def replica_of_id(response_id: Any, id_prefixes: Mapping[str, str]) -> str | None:
    """The replica that wrote a response id, from each replica's id prefix (see ``id_prefix``).

    For routers that do not say where they sent a request (no ``x-prefix-gateway-replica``
    header): the replicas stamp their response ids with a per-process prefix.
    """
    if not isinstance(response_id, str) or not id_prefixes:
        return None
    part = response_id.split("-", 1)[-1]
    for prefix, name in id_prefixes.items():
        if part.startswith(prefix):
            return name
    return None


def id_prefix(ids: Sequence[str], length: int = 12) -> str | None:
    """The per-replica part of response ids (``cmpl-<prefix><counter>``) from two or more of them:
    their common head after the first dash, ``length`` characters, or ``None`` if they share less."""
    parts = [i.split("-", 1)[-1] for i in ids]
    if len(parts) < 2:
        return None
    head = parts[0][:length]
    return head if len(head) == length and all(p.startswith(head) for p in parts) else None


async def _send_one(
    session: aiohttp.ClientSession,
    base_url: str,
    req: WireRequest,
    out: Outcome,
    clock: Any,
    default_replica: str | None,
    id_prefixes: Mapping[str, str] | None = None,
) -> None:
    out.sent = clock()
    try:
        async with session.post(base_url + req.path, data=req.body, headers=req.headers) as resp:
            out.status = resp.status
            out.replica = resp.headers.get(REPLICA_HEADER, default_replica)
            if resp.status != 200:
                text = (await resp.text())[:300]
                out.error = f"http {resp.status}: {text}"
                out.done = clock()
                return
            async for raw in resp.content:
                if not raw.startswith(b"data:"):
                    continue
                payload = raw[5:].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if out.replica is None and id_prefixes:
                    out.replica = replica_of_id(chunk.get("id"), id_prefixes)
                if "error" in chunk and not chunk.get("choices"):
                    out.error = f"stream error: {str(chunk['error'])[:300]}"
                    break
                if out.first_token is None and _content_of(chunk):
                    out.first_token = clock()
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens")
                    out.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens") if isinstance(details, dict) else None
                    out.cached_tokens = int(cached) if cached is not None else None
            out.done = clock()
            if out.first_token is None and out.error is None:
                out.error = "stream ended without content"
    except asyncio.CancelledError:
        out.error = out.error or "deadline"
        raise
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
        out.done = clock()


async def replay(
    requests: Sequence[WireRequest],
    base_urls: Sequence[str],
    *,
    deadline_s: float,
    replica_names: Sequence[str] | None = None,
    via_gateway: bool = True,
    id_prefixes: Mapping[str, str] | None = None,
) -> ReplayResult:
    """Send ``requests`` open-loop; stop at ``deadline_s`` seconds after the start.

    With one URL (a gateway, or the pooled oracle) everything goes there.  With several URLs
    the client round-robins over them (several gateways, as a Service spreads connections; or,
    in direct mode, the replicas themselves, each request labelled with the replica it chose).
    Every outcome records the URL it was sent to.  With gateways, ``base_urls`` may be a list
    the caller extends during the run (a gateway joining): each request goes to the next URL
    in turn among those listed when it is sent.  ``replica_names`` lists every replica so that
    idle ones still count in the load statistics.  ``id_prefixes`` (response-id prefix ->
    replica name) attributes responses of a router that sends no replica header.
    """
    n_urls = len(base_urls)
    names = list(replica_names or ([f"r{i}" for i in range(n_urls)] if n_urls > 1 else ["oracle"]))
    outcomes = [Outcome(index=i, scheduled=r.at) for i, r in enumerate(requests)]
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    loop = asyncio.get_running_loop()
    start = loop.time()

    def clock() -> float:
        return loop.time() - start

    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:

        async def dispatch() -> None:
            for i, req in enumerate(requests):
                delay = req.at - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                if clock() >= deadline_s:
                    break
                url = base_urls[i % len(base_urls)] if via_gateway else base_urls[i % n_urls]
                default = None if via_gateway else names[i % n_urls] if n_urls > 1 else names[0]
                outcomes[i].sent_to = url
                tasks.append(loop.create_task(_send_one(session, url, req, outcomes[i], clock, default, id_prefixes)))

        dispatcher = loop.create_task(dispatch())
        deadline_hit = False
        try:
            await asyncio.wait_for(asyncio.shield(dispatcher), timeout=max(deadline_s - clock(), 0.01))
            remaining = max(deadline_s - clock(), 0.01)
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=remaining)
                deadline_hit = bool(pending)
        except TimeoutError:
            deadline_hit = True
        ended = clock()
        dispatcher.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(dispatcher, *tasks, return_exceptions=True)
    for out in outcomes:
        if math.isnan(out.sent):
            out.error = out.error or "not sent (deadline)"
    return ReplayResult(outcomes, time.time() - ended, ended, deadline_hit, names)


# -- summary --------------------------------------------------------------------------------


@dataclass(slots=True)
class LoadStats:
    """Per-replica in-flight load over time, from the requests' [sent, done] intervals."""

    replicas: list[str]
    requests_per_replica: dict[str, int]
    mean_in_flight: dict[str, float]
    peak_in_flight: dict[str, int]
    max_over_mean: float  # time-average of max_r(L_r) / mean_r(L_r) while anything is in flight
    max_over_mean_p99: float
    cv: float  # time-average of stddev_r(L_r) / mean_r(L_r)
    bound_ok_share: float  # share of time with max_r(L_r) <= 1.25 * mean_r(L_r) + 1
    worst_excess: float  # max over time of max_r(L_r) - (1.25 * mean_r(L_r) + 1)
    # The same bound checked where a router can enforce it: at each assignment, the chosen
    # replica's in-flight (this request included) vs 1.25 x the mean (this request included) + 1.
    assign_bound_ok_share: float = math.nan
    assign_max_over_mean_p99: float = math.nan
    assign_worst_excess: float = math.nan
    # Client timestamps are skewed against the gateway's (the client's event loop lags under
    # load, bodies of different sizes reach the gateway in a different order): the conservative
    # check counts, on the chosen replica, only requests certainly in flight (sent more than
    # ``skew_s`` before and finished more than ``skew_s`` after) and bounds it with every
    # request possibly in flight.  A violation here happened whatever the skew.
    skew_s: float = math.nan
    assign_certain_ok_share: float = math.nan
    assign_certain_worst_excess: float = math.nan


def load_stats(
    outcomes: Sequence[Outcome], replicas: Sequence[str], end: float, step: float = 0.005, skew_s: float = 0.02
) -> LoadStats:
    """Sample every replica's in-flight count every ``step`` seconds (exact, from intervals)."""
    names = list(replicas)
    extra = sorted({o.replica for o in outcomes if o.replica and o.replica not in names})
    names += extra
    index = {n: i for i, n in enumerate(names)}
    counts = {n: 0 for n in names}
    spans = [
        (o.sent, o.done if o.done is not None else end, index[o.replica])
        for o in outcomes
        if o.replica is not None and not math.isnan(o.sent)
    ]
    for o in outcomes:
        if o.replica is not None:
            counts[o.replica] += 1
    if not spans:
        zero = {n: 0.0 for n in names}
        return LoadStats(names, counts, zero, {n: 0 for n in names}, math.nan, math.nan, math.nan, math.nan, math.nan)
    t_end = max(s[1] for s in spans)
    t0 = min(s[0] for s in spans)
    grid = np.arange(t0, t_end, step)
    load = np.zeros((len(names), len(grid)), dtype=np.int32)
    for sent, done, r in spans:
        a, b = np.searchsorted(grid, [sent, done])
        load[r, a:b] += 1
    mean = load.mean(axis=0)
    busy = mean > 0
    if not busy.any():
        zero = {n: 0.0 for n in names}
        return LoadStats(names, counts, zero, {n: 0 for n in names}, math.nan, math.nan, math.nan, math.nan, math.nan)
    assign = _assignment_bound(spans, len(names), skew_s)
    peak = load.max(axis=0)
    ratio = peak[busy] / mean[busy]
    cv = load[:, busy].std(axis=0) / mean[busy]
    excess = peak[busy] - (1.25 * mean[busy] + 1.0)
    return LoadStats(
        replicas=names,
        requests_per_replica=counts,
        mean_in_flight={n: float(load[i].mean()) for i, n in enumerate(names)},
        peak_in_flight={n: int(load[i].max()) for i, n in enumerate(names)},
        max_over_mean=float(ratio.mean()),
        max_over_mean_p99=float(np.percentile(ratio, 99)),
        cv=float(cv.mean()),
        bound_ok_share=float((excess <= 1e-9).mean()),
        worst_excess=float(excess.max()),
        **assign,
    )


def _assignment_bound(spans: Sequence[tuple[float, float, int]], n_replicas: int, skew_s: float) -> dict[str, float]:
    """At each request's dispatch (in dispatch order), the load of the replica it went to."""
    sent = np.array([s[0] for s in spans])
    done = np.array([s[1] for s in spans])
    rep = np.array([s[2] for s in spans])
    n = len(spans)
    order = np.argsort(sent, kind="stable")
    sent, done, rep = sent[order], done[order], rep[order]
    onehot = np.zeros((n, n_replicas), dtype=np.int32)
    onehot[np.arange(n), rep] = 1
    rows = np.arange(n)
    # point estimate: j dispatched before i and not yet finished when i was sent
    open_at = np.tri(n, k=-1, dtype=bool) & (done[None, :] > sent[:, None])
    loads = open_at.astype(np.int32) @ onehot + onehot
    chosen = loads[rows, rep]
    mean = loads.sum(axis=1) / n_replicas
    excess = chosen - (1.25 * mean + 1.0)
    # conservative: certainly in flight on the chosen replica vs everything possibly in flight
    others = ~np.eye(n, dtype=bool)
    certain = others & (sent[None, :] < sent[:, None] - skew_s) & (done[None, :] > sent[:, None] + skew_s)
    possible = others & (sent[None, :] < sent[:, None] + skew_s) & (done[None, :] > sent[:, None] - skew_s)
    chosen_min = (certain.astype(np.int32) @ onehot)[rows, rep] + 1
    total_max = possible.sum(axis=1) + 1
    certain_excess = chosen_min - (1.25 * total_max / n_replicas + 1.0)
    return {
        "assign_bound_ok_share": float((excess <= 1e-9).mean()),
        "assign_max_over_mean_p99": float(np.percentile(chosen / mean, 99)),
        "assign_worst_excess": float(excess.max()),
        "skew_s": skew_s,
        "assign_certain_ok_share": float((certain_excess <= 1e-9).mean()),
        "assign_certain_worst_excess": float(certain_excess.max()),
    }


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


@dataclass(slots=True)
class RunSummary:
    """One (workload, load level, policy) run, as stored in the results JSON."""

    requests: int
    ok: int
    errors: int
    unfinished: int
    error_samples: list[str]
    hit_rate: float | None  # sum(cached_tokens) / sum(prompt_tokens) over responses that reported both
    cached_unknown: int  # responses without cached_tokens
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: dict[str, float | None]  # p50 / p90 / p99 / mean; unfinished count as censored (>=)
    ttft_censored: int  # requests with no first token by the deadline (counted at their elapsed time)
    e2e_ms_p50: float | None
    throughput_rps: float
    throughput_tok_s: float  # (prompt + completion tokens) of finished requests per second
    output_tok_s: float
    span_s: float
    max_dispatch_lag_ms: float
    load: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(result: ReplayResult) -> RunSummary:
    """Reduce outcomes to the numbers of the table (times in ms of wall-clock time)."""
    outs = result.outcomes
    sent = [o for o in outs if not math.isnan(o.sent)]
    ok = [o for o in outs if o.ok]
    errors = [o for o in outs if o.error and o.error not in ("deadline", "not sent (deadline)")]
    unfinished = [o for o in outs if o.error in ("deadline", "not sent (deadline)")]
    reported = [o for o in ok if o.cached_tokens is not None and o.prompt_tokens]
    prompt = sum(o.prompt_tokens or 0 for o in reported)
    cached = sum(o.cached_tokens or 0 for o in reported)
    ttfts = [o.ttft for o in sent if o.ttft is not None]
    # A request with no first token by the deadline waited at least until then: keep it in the
    # percentiles at that lower bound, or a policy that queues forever would look fast.
    censored = [result.ended - o.sent for o in sent if o.ttft is None and o.error == "deadline"]
    all_ttft = [t * 1000 for t in ttfts + censored]
    if ok:
        first = min(o.sent for o in ok)
        last = max(o.done for o in ok if o.done is not None)
        span = max(last - first, 1e-6)
    else:
        span = max(result.ended, 1e-6)
    tokens = sum((o.prompt_tokens or 0) + (o.completion_tokens or 0) for o in ok)
    out_tokens = sum(o.completion_tokens or 0 for o in ok)
    lag = max((o.sent - o.scheduled for o in sent), default=0.0)
    # the client's own scheduling lag bounds how far its timestamps can be off the gateway's
    lags = [o.sent - o.scheduled for o in sent]
    skew = 0.02 + (float(np.percentile(lags, 99)) if lags else 0.0)
    stats = load_stats(outs, result.replicas, result.ended, skew_s=skew)
    return RunSummary(
        requests=len(outs),
        ok=len(ok),
        errors=len(errors),
        unfinished=len(unfinished),
        error_samples=sorted({o.error or "" for o in errors})[:5],
        hit_rate=cached / prompt if prompt else None,
        cached_unknown=sum(1 for o in ok if o.cached_tokens is None),
        prompt_tokens=prompt,
        cached_tokens=cached,
        ttft_ms={
            "p50": _pct(all_ttft, 50),
            "p90": _pct(all_ttft, 90),
            "p99": _pct(all_ttft, 99),
            "mean": float(np.mean(all_ttft)) if all_ttft else None,
        },
        ttft_censored=len(censored),
        e2e_ms_p50=_pct([(o.done - o.sent) * 1000 for o in ok if o.done is not None], 50),
        throughput_rps=len(ok) / span,
        throughput_tok_s=tokens / span,
        output_tok_s=out_tokens / span,
        span_s=span,
        max_dispatch_lag_ms=lag * 1000,
        load=asdict(stats),
    )


def median_of_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One summary from repeated runs of the same cell: the median of every numeric field.

    Nested dicts (TTFT percentiles, load statistics) are merged field by field; a field that
    some runs lack (None) takes the median of the runs that have it; anything else (error
    samples, names) comes from the first run.  Medians, not means: one run that a neighbour
    on the machine slowed down must not move the verdict.
    """
    if not runs:
        return {}
    if len(runs) == 1:
        return dict(runs[0])
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [run.get(key) for run in runs]
        if all(isinstance(v, dict) for v in values):
            out[key] = median_of_runs(values)  # type: ignore[arg-type]
            continue
        numeric = all(v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in values)
        numbers = [v for v in values if v is not None and not math.isnan(v)] if numeric else []
        if not numbers:
            out[key] = first
            continue
        median = float(np.median(numbers))
        # counts stay ints where the median is whole (the table prints "320/320", not "320.0")
        out[key] = int(median) if median.is_integer() and all(isinstance(v, int) for v in numbers) else median
    return out
