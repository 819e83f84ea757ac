"""A gateway joining a replay mid-run, and how its first requests compare with its peers'.

``bench_fleet.py``'s join rows: the replay runs on 2 gateways; ``Joiner`` starts a 3rd one
during it and, once its ``/ready`` answers, appends its URL to the list the replayer spreads
requests over (``replay`` reads that list at each send).  From its start it samples the
joiner's ``/admin/stats`` counter of peer records applied, which shows when the peers' catch-up
snapshot landed (a burst of records, against a trickle of live ones): before ``/ready``, since
a joining gateway waits for it (``gateway/state/catchup.py``).

``join_window`` then compares, over the joiner's first window, the hit rate of the requests
it served with that of the requests the others served in the same window, with a bootstrap
standard error: the windows hold tens to a few hundred requests of very different prompt
lengths, so a gap of a few points may be noise, and the table says how much.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.bench_warm_restart import window_stats
from benchmarks.processes import stop_all
from benchmarks.replay import Outcome, ReplayResult, WireRequest, replay

POLL_S = 0.05  # readiness polling
# A gateway sends at most one catch-up snapshot per this many seconds (``CatchUp.min_interval_s``)
# and the peers sent one to each other when they met: a process joining sooner than that after
# them gets none (rate limited), which is not what the join rows measure.
PEER_SNAPSHOT_INTERVAL_S = 5.0
SAMPLE_S = 0.1  # the joiner's applied-records counter, from ready to the end of the run


def admin_state(url: str, admin_key: str) -> dict[str, Any]:
    """The gateway's shared-state counters (``/admin/stats`` → ``state``); empty if it does not answer."""
    req = urllib.request.Request(url + "/admin/stats", headers={"authorization": f"Bearer {admin_key}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read()).get("state") or {}
    except (urllib.error.URLError, OSError, ValueError):
        return {}


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class Joiner:
    """The gateway that joins a replay: started ``at_s`` into it, sent requests once ``/ready`` answers.

    ``replay`` is a drop-in for ``benchmarks.replay.replay`` (``bench_policies.run_once``'s
    ``replayer``).  Times are seconds on the replay's clock.
    """

    launch: Callable[[], Any]  # starts the process (a ManagedProcess: url, process, log_path); no wait
    at_s: float
    admin_key: str
    not_before: float = 0.0  # time.monotonic() before which it is not started (PEER_SNAPSHOT_INTERVAL_S)
    ready_timeout_s: float = 60.0
    proc: Any = None
    launched_s: float | None = None
    ready_s: float | None = None
    applied: list[tuple[float, int]] = field(default_factory=list)  # (time, peer records applied so far)
    applied_at_ready: int | None = None
    peers_records_at_launch: list[int] = field(default_factory=list)  # records_sent of each peer then
    error: str | None = None
    result: ReplayResult | None = field(default=None, repr=False)

    @property
    def url(self) -> str | None:
        return self.proc.url if self.proc is not None and self.ready_s is not None else None

    async def replay(self, wire: Sequence[WireRequest], targets: list[str], **kwargs: Any) -> ReplayResult:
        loop = asyncio.get_running_loop()
        t0 = loop.time()  # the replay's clock starts within microseconds of this (no await between)
        join = loop.create_task(self._join(targets, lambda: loop.time() - t0))
        try:
            self.result = await replay(wire, targets, **kwargs)
        finally:
            join.cancel()  # a joiner not ready when the run ends never serves; stop() ends it
            await asyncio.gather(join, return_exceptions=True)
        return self.result

    async def _join(self, targets: list[str], clock: Callable[[], float]) -> None:
        await asyncio.sleep(self.at_s)
        await asyncio.sleep(max(0.0, self.not_before - time.monotonic()))
        peers = list(targets)
        states = await asyncio.gather(*(asyncio.to_thread(admin_state, u, self.admin_key) for u in peers))
        self.peers_records_at_launch = [int(s.get("records_sent") or 0) for s in states]
        self.launched_s = clock()

        def launch() -> None:  # in a thread; it sets proc itself, so a cancelled wait cannot lose it
            self.proc = self.launch()

        try:
            await asyncio.to_thread(launch)
        except (OSError, RuntimeError) as exc:
            self.error = f"the joining gateway did not start: {exc}"
            return
        deadline = clock() + self.ready_timeout_s
        while not await asyncio.to_thread(is_ready, self.proc.url):
            if self.proc.process.poll() is not None or clock() > deadline:
                self.error = f"the joining gateway did not become ready; log: {self.proc.log_path}"
                return
            await self._sample_applied(clock)
            await asyncio.sleep(POLL_S)
        self.ready_s = clock()
        targets.append(self.proc.url)  # the replay sends it every n-th request from now on
        await self._sample_applied(clock)
        self.applied_at_ready = self.applied[-1][1] if self.applied else None
        while True:  # until the run ends (cancelled)
            await asyncio.sleep(SAMPLE_S)
            await self._sample_applied(clock)

    async def _sample_applied(self, clock: Callable[[], float]) -> None:
        state = await asyncio.to_thread(admin_state, self.proc.url, self.admin_key)
        if "applied" in state:
            self.applied.append((round(clock(), 3), int(state["applied"])))

    def records_since_launch(self, peers_records_now: Sequence[int]) -> list[int]:
        """Records each peer sent in snapshots since the joiner started (its catch-up)."""
        return [now - then for now, then in zip(peers_records_now, self.peers_records_at_launch, strict=False)]

    def snapshot_landed_s(self, peers_records_now: Sequence[int]) -> float | None:
        """When the joiner had applied half of the smallest snapshot a peer sent since it was ready.

        ``peers_records_now``: each peer's ``records_sent`` after the run.  Live records arrive
        at the request rate (a few per sample); a snapshot adds hundreds to thousands at once,
        so crossing half of one is its arrival, to within ``SAMPLE_S``.  None: none was sent
        (catch-up off) or none arrived before the run ended.
        """
        smallest = min((n for n in self.records_since_launch(peers_records_now) if n > 0), default=0)
        if not self.applied or smallest <= 0:
            return None
        return next((t for t, n in self.applied if n >= smallest / 2), None)

    def stop(self) -> None:
        if self.proc is not None:
            stop_all([self.proc])


def hit_rate_se(outcomes: Sequence[Outcome], draws: int = 400, seed: int = 0) -> float | None:
    """Bootstrap standard error of the token-weighted hit rate of ``outcomes`` (resampled by request)."""
    ok = [o for o in outcomes if o.ok and o.prompt_tokens and o.cached_tokens is not None]
    if len(ok) < 2:
        return None
    prompt = np.array([o.prompt_tokens for o in ok], dtype=float)
    cached = np.array([o.cached_tokens for o in ok], dtype=float)
    picks = np.random.default_rng(seed).integers(0, len(ok), size=(draws, len(ok)))
    return float(np.std(cached[picks].sum(axis=1) / prompt[picks].sum(axis=1)))


def join_window(
    outcomes: Sequence[Outcome], joiner_url: str | None, window_s: float, run_end_s: float, after_s: float | None = None
) -> dict[str, Any]:
    """The joiner's first ``window_s`` against the others' requests sent in the same window.

    The window opens at the joiner's first request and closes ``window_s`` later or when the
    arrivals end (``run_end_s``), whichever is first; ``gap_points`` is the others' hit rate
    minus the joiner's, in points, with its bootstrap standard error.  ``after_s`` (when the
    catch-up snapshot landed) adds the same comparison from then on.
    """
    mine = sorted((o for o in outcomes if joiner_url is not None and o.sent_to == joiner_url), key=lambda o: o.sent)
    if not mine:
        return {"joiner": {"requests": 0}, "gap_points": None, "gap_se_points": None}
    start = mine[0].sent
    end = start + window_s
    others = [o for o in outcomes if o.sent_to != joiner_url]
    out = {
        "window": {
            "start_s": round(start, 3),
            "end_s": round(min(end, run_end_s), 3),
            "length_s": round(window_s, 2),
            "cut_by_end_of_run": end > run_end_s,
        },
        **_compare(mine, others, start, end),
    }
    if after_s is not None and after_s < min(end, run_end_s):
        out["after_snapshot"] = {"start_s": round(after_s, 3), **_compare(mine, others, after_s, end)}
    return out


def _compare(mine: Sequence[Outcome], others: Sequence[Outcome], start: float, end: float) -> dict[str, Any]:
    def sent_in(outs: Sequence[Outcome]) -> list[Outcome]:
        return [o for o in outs if start <= o.sent < end]

    a, b = sent_in(mine), sent_in(others)
    joiner, rest = window_stats(a, start, end), window_stats(b, start, end)
    gap = se = None
    if joiner["hit_rate"] is not None and rest["hit_rate"] is not None:
        gap = round(100 * (rest["hit_rate"] - joiner["hit_rate"]), 2)
        ses = [hit_rate_se(a), hit_rate_se(b)]
        se = round(100 * float(np.hypot(*ses)), 2) if None not in ses else None
    return {"joiner": joiner, "others": rest, "gap_points": gap, "gap_se_points": se}
