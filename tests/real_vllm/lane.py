"""The real-engine tests' view of a gateway in front of real vLLM replicas.

Per-request predictions are read the way an operator could: ``GET /admin/stats`` keeps, per
(route, replica), the sum of predicted cached tokens and the count of predicted requests; the
tests send one request at a time, so the difference across a request is that request's
prediction, and the SDK's ``usage.prompt_tokens_details.cached_tokens`` is what vLLM reported.
The gateway runs with its default settings: the replicas listed and nothing else about prefixes
(an admin key, to read the stats, and port 0).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from openai import OpenAI

from gateway.config import parse_config
from gateway.http.server import RunningGateway, serve_in_thread
from tests.polling import wait_for
from tests.real_vllm.engine import SERVED_MODEL, Replica
from tests.sdk import openai_client

ADMIN_KEY = "real-lane-admin-key"
ROUTE = "default"  # the route a config without routes gets


@dataclass
class Observation:
    """One request through the gateway: where it went, what vLLM reported, what the gateway predicted."""

    id: str
    replica: str
    prompt_tokens: int
    cached_tokens: int | None
    predicted: int | None
    content: str
    reason: str | None = None  # the routing decision's reason (ring, affinity, load...), from the stats
    seen_prompt_tokens: int | None = None  # prompt tokens the gateway read from the reply's usage
    gateway_error: bool = False  # the gateway counted the request as an error (e.g. 499: the client left)

    @property
    def agrees(self) -> bool:
        return self.predicted is not None and self.predicted == self.cached_tokens


class Front:
    """A gateway with default settings over the lane's replicas, plus the means to read it."""

    def __init__(self, gw: RunningGateway, replicas: Sequence[Replica]) -> None:
        self.gw = gw
        self.replicas = {f"r{i}": r for i, r in enumerate(replicas)}
        self.admin = httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
        self.sdk: OpenAI = openai_client(gw.openai_base_url, api_key="unused", timeout=300)
        self.log: list[Observation] = []

    def stats(self) -> dict[str, Any]:
        r = self.admin.get("/admin/stats")
        r.raise_for_status()
        return r.json()

    def tallies(self) -> dict[str, dict[str, Any]]:
        return self.route()["replicas"]

    def route(self) -> dict[str, Any]:
        return self.stats()["routes"][ROUTE]

    def mode(self, name: str) -> str | None:
        """The replica's routing mode as the gateway reports it ("precise" | "approximate"), if it does."""
        stats = self.stats()
        row = (stats.get("kv_events") or {}).get("replicas", {}).get(name)
        if isinstance(row, dict) and row.get("mode"):
            return str(row["mode"])
        mode = stats["routes"][ROUTE]["replicas"].get(name, {}).get("kv_mode")
        return None if mode is None else str(mode)

    def events_heard(self, name: str) -> int | None:
        """KV event messages the gateway received from ``name`` (None: the gateway does not say)."""
        row = (self.stats().get("kv_events") or {}).get("replicas", {}).get(name)
        return row.get("messages") if isinstance(row, dict) else None

    def settle_events(self, name: str, quiet: float = 0.5, timeout: float = 15.0) -> None:
        """Until the gateway has heard no new KV event message from ``name`` for ``quiet`` seconds.

        Events travel apart from the replies (ZMQ, after the engine's step), so a test that changes
        the engine's cache behind the gateway's back lets them arrive before the next request. A
        gateway that reports no event counts has nothing to wait for.
        """
        if self.events_heard(name) is None:
            return
        state = {"seen": self.events_heard(name), "since": time.monotonic()}

        def quiet_now() -> bool:
            now = self.events_heard(name)
            if now != state["seen"]:
                state["seen"], state["since"] = now, time.monotonic()
            return time.monotonic() - state["since"] >= quiet

        wait_for(quiet_now, timeout, 0.05, f"the KV events of {name} to settle")

    def kv_row(self, name: str) -> dict[str, Any] | None:
        """The gateway's KV-event view of ``name`` (mode, counts), for failure messages."""
        row = (self.stats().get("kv_events") or {}).get("replicas", {}).get(name)
        keep = ("mode", "reason", "messages", "events", "clears", "restarts", "gaps", "indexed_blocks")
        return {k: row.get(k) for k in keep} if isinstance(row, dict) else None

    def poke(self, name: str) -> None:
        """One tiny request straight to the replica (no full block: it stores nothing).

        vLLM 0.32 publishes KV events once per scheduler step, and an idle engine takes none: a
        reset or a restart is announced (AllBlocksCleared, a sequence back at 0) with the next step
        it runs. A fleet serving traffic runs steps all the time; the tests' idle one is poked.
        """
        body = {"model": SERVED_MODEL, "prompt": "ok", "max_tokens": 1}
        r = httpx.post(self.replicas[name].url + "/v1/completions", json=body, timeout=120)
        r.raise_for_status()

    def wait_scraped(self, timeout: float = 60.0) -> None:
        """Until every replica's /metrics was read once (block size known): what auto alignment needs."""

        def scraped() -> bool:
            replicas = self.stats()["replicas"]
            return all((replicas[n].get("engine") or {}).get("block_size") for n in self.replicas)

        wait_for(scraped, timeout, 0.2, "the gateway's first scrape of every replica")

    def wait_healthy(self, name: str, timeout: float = 60.0) -> None:
        wait_for(lambda: self.stats()["replicas"][name]["healthy"], timeout, 0.2, f"{name} healthy in the gateway")

    def send(self, rid: str, endpoint: str, body: dict[str, Any]) -> Observation:
        """One request with the official SDK; its prediction from the stats difference."""
        route_before = self.route()
        before = route_before["replicas"]
        kwargs = dict(body)
        extra = {k: kwargs.pop(k) for k in ("cache_salt",) if k in kwargs}
        if extra:
            kwargs["extra_body"] = extra
        api = self.sdk.chat.completions if endpoint == "chat" else self.sdk.completions
        raw = api.with_raw_response.create(**kwargs)
        replica = raw.headers["x-prefix-gateway-replica"]
        usage, content = _read(raw.parse(), endpoint, bool(body.get("stream")))
        total = sum(t.get("requests", 0) for t in before.values()) + 1
        wait_for(
            lambda: sum(t.get("requests", 0) for t in self.tallies().values()) >= total,
            30,
            0.02,
            "the gateway to account the request",
        )
        route_after = self.route()
        after = route_after["replicas"][replica]
        was = before.get(replica, {})
        reasons = [
            k for k, v in route_after.get("reasons", {}).items() if v > route_before.get("reasons", {}).get(k, 0)
        ]
        predicted = None
        if after.get("predicted_requests", 0) > was.get("predicted_requests", 0):
            predicted = after["predicted_cached_tokens"] - was.get("predicted_cached_tokens", 0)
        details = getattr(usage, "prompt_tokens_details", None)
        obs = Observation(
            id=rid,
            replica=replica,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=None if details is None else details.cached_tokens,
            predicted=predicted,
            content=content,
            reason=",".join(reasons) or None,
            seen_prompt_tokens=after.get("prompt_tokens", 0) - was.get("prompt_tokens", 0),
            gateway_error=after.get("errors", 0) > was.get("errors", 0),
        )
        self.log.append(obs)
        return obs


def _read(reply: Any, endpoint: str, stream: bool) -> tuple[Any, str]:
    """(usage, text) of a reply, streamed (usage from the include_usage chunk) or not."""
    if not stream:
        choice = reply.choices[0]
        text = choice.message.content if endpoint == "chat" else choice.text
        return reply.usage, text or ""
    usage, parts = None, []
    for chunk in reply:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if endpoint == "chat" else choice.text
            parts.append(piece or "")
    assert usage is not None, "a stream with include_usage ends with a usage chunk"
    return usage, "".join(parts)


#: JSON merged into the gateway's config, to check the harness itself (e.g. ``{"routes": [{"name":
#: "default", "prefix": {"block_size": 128}}]}`` isolates alignment from the rest); CI never sets it.
CONFIG_ENV = "PREFIX_GATEWAY_REAL_VLLM_GATEWAY"


@contextlib.contextmanager
def front(replicas: Sequence[Replica], settings: dict[str, Any] | None = None) -> Iterator[Front]:
    """The gateway with its defaults (replicas listed; no routes, no prefix settings) in a thread;
    ``settings``: what a test sets on top (merged like :data:`CONFIG_ENV`, which still wins)."""
    data: dict[str, Any] = {
        "server": {"port": 0},
        "replicas": [{"name": f"r{i}", "url": r.url} for i, r in enumerate(replicas)],
    }
    data.update(settings or {})
    data.update(json.loads(os.environ.get(CONFIG_ENV) or "{}"))
    config = parse_config(data, "<real lane>")
    saved = os.environ.get("PREFIX_GATEWAY_ADMIN_KEY")
    os.environ["PREFIX_GATEWAY_ADMIN_KEY"] = ADMIN_KEY
    try:
        with serve_in_thread(config) as gw:
            f = Front(gw, replicas)
            f.wait_scraped()
            yield f
    finally:
        if saved is None:
            os.environ.pop("PREFIX_GATEWAY_ADMIN_KEY", None)
        else:
            os.environ["PREFIX_GATEWAY_ADMIN_KEY"] = saved


def summary(observations: Sequence[Observation]) -> str:
    """A line per disagreement (for the failure message and the lane's printed numbers)."""
    bad = [o for o in observations if not o.agrees]
    lines = [f"{len(observations) - len(bad)}/{len(observations)} predictions equal vLLM's cached_tokens"]
    lines += [
        f"  {o.id} on {o.replica} ({o.reason}): predicted {o.predicted}, vLLM {o.cached_tokens} of {o.prompt_tokens}"
        + ("" if o.seen_prompt_tokens == o.prompt_tokens else f" (the gateway read {o.seen_prompt_tokens})")
        + (" (counted as an error by the gateway)" if o.gateway_error else "")
        for o in bad
    ]
    return "\n".join(lines)
