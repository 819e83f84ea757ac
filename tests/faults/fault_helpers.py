"""Shared pieces of the fault suite: a gateway over the fault fleet, polling, small requests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
from openai import OpenAI

from benchmarks.faultload import MODEL, Load
from gateway.http.server import RunningGateway, serve_in_thread
from tests.configs import gateway_config
from tests.polling import wait_for
from tests.sdk import openai_client

__all__ = ["MODEL", "Load", "gateway", "replica_of", "sdk", "set_faults", "wait_for"]


@contextlib.contextmanager
def gateway(urls: list[str], **overrides: Any) -> Iterator[RunningGateway]:
    """A gateway (in a thread) over ``urls``; fast health checks as in every test config."""
    with serve_in_thread(gateway_config(urls, **overrides)) as gw:
        yield gw


def sdk(gw: RunningGateway, timeout: float = 30.0) -> OpenAI:
    return openai_client(gw.openai_base_url, api_key="unused", timeout=timeout)


def replica_of(gw: RunningGateway, session: str) -> str:
    """Which replica answers a request of ``session`` (the session policy's key) now."""
    raw = sdk(gw).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "where am I"}],
        max_tokens=1,
        extra_headers={"x-session-id": session},
    )
    return raw.headers["x-prefix-gateway-replica"]


def set_faults(url: str, **faults: Any) -> None:
    httpx.post(f"{url}/sim/faults", json=faults, timeout=10).raise_for_status()
