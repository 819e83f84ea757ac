"""Helpers for the fleet tests: replicas on several loopback addresses, and steady streaming load.

DNS and EndpointSlices name replicas by *address* with one shared port, so the simulated
replicas here each listen on their own loopback address (127.0.0.2, 127.0.0.3, ...) and the
same port, as pods behind a headless Service do.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.http.server import RunningGateway, serve_in_thread
from gateway.sim.launcher import ReplicaGroup
from tests.configs import gateway_config

MODEL = "demo-model"
ADMIN_KEY = "fleet-admin"  # the tests set PREFIX_GATEWAY_ADMIN_KEY to it
SLOW = {  # streams of ~0.3 s: long enough to be cut by a careless membership change
    "time_scale": 1.0,
    "decode_ms_per_token": 15.0,
    "max_output_tokens": 20,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}


def shared_free_port(addresses: list[str]) -> int:
    """A port free on every one of ``addresses``."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((addresses[0], 0))
            port = probe.getsockname()[1]
        ok = True
        for address in addresses:
            with socket.socket() as sock:
                try:
                    sock.bind((address, port))
                except OSError:
                    ok = False
                    break
        if ok:
            return port
    raise RuntimeError("no port free on every loopback address")


@contextlib.contextmanager
def loopback_replicas(n: int, log_dir: Path, **options: Any) -> Iterator[tuple[int, list[str]]]:
    """``n`` simulated replicas on 127.0.0.2.. with one shared port: yields (port, addresses)."""
    addresses = [f"127.0.0.{i + 2}" for i in range(n)]
    port = shared_free_port(addresses)
    with contextlib.ExitStack() as stack:
        for i, address in enumerate(addresses):
            group = ReplicaGroup(1, host=address, ports=[port], log_dir=log_dir / f"sim{i}", **{**SLOW, **options})
            stack.enter_context(group.start())
        yield port, addresses


@dataclass
class Load:
    """``workers`` threads streaming chat completions through the gateway until stopped."""

    base_url: str
    workers: int = 6
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    replicas: Counter[str] = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _work(self, worker: int) -> None:
        client = OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=30)
        i = 0
        while not self._stop.is_set():
            i += 1
            messages = [{"role": "user", "content": f"worker {worker} question {i}: " + "tell me more. " * 30}]
            try:
                with client.chat.completions.with_streaming_response.create(
                    model=MODEL, messages=messages, stream=True, max_tokens=20
                ) as response:
                    replica = response.headers.get("x-prefix-gateway-replica", "?")
                    finish = None
                    for chunk in response.parse():
                        if chunk.choices and chunk.choices[0].finish_reason:
                            finish = chunk.choices[0].finish_reason
                if finish is None:
                    raise RuntimeError("stream ended without a finish_reason")
                with self._lock:
                    self.ok += 1
                    self.replicas[replica] += 1
            except Exception as exc:  # every failure is a test failure: keep them all
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> Load:
        for worker in range(self.workers):
            thread = threading.Thread(target=self._work, args=(worker,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


def discovered_gateway(source: dict[str, Any]) -> Any:
    config = gateway_config([], replicas=[], discovery=[source], routes=[{"name": "main", "policy": "prefix"}])
    return serve_in_thread(config)


def stats(gw: RunningGateway) -> dict[str, Any]:
    response = httpx.get(f"{gw.url}/admin/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    response.raise_for_status()
    return response.json()


def pool(gw: RunningGateway) -> list[str]:
    return [r.name for r in gw.gateway.routes.get("main").runner.replicas]  # type: ignore[union-attr]


def healthy_pool(gw: RunningGateway) -> list[str]:
    return [r.name for r in gw.gateway.routes.get("main").runner.replicas if r.healthy]  # type: ignore[union-attr]


def metrics(gw: RunningGateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{gw.url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
