"""Shared helpers for the gateway tests: configs, polling with deadlines, sim admin calls."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig, parse_config
from gateway.server import RunningGateway, serve_in_thread
from tests.polling import wait_for  # noqa: F401  (re-exported to the tests)

MODEL = "demo-model"
T = TypeVar("T")


def gateway_config(urls: Sequence[str], **overrides: Any) -> GatewayConfig:
    """A test config over ``urls`` (replicas r0..rN): fast health checks, no summary loop."""
    data: dict[str, Any] = {
        "server": {"port": 0},
        "health": {"interval_s": 0.2, "timeout_s": 1.0, "unhealthy_threshold": 1, "eject_s": 0.5},
        "scrape": {"interval_s": 0.2},
        "logging": {"summary_interval_s": 0},
        "replicas": [{"name": f"r{i}", "url": url} for i, url in enumerate(urls)],
        "routes": [{"name": "main", "policy": "least_loaded"}],
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return parse_config(data, "<test>")


@contextlib.contextmanager
def running_gateway(urls: Sequence[str], **overrides: Any) -> Iterator[RunningGateway]:
    with serve_in_thread(gateway_config(urls, **overrides)) as gw:
        yield gw


def client(gw: RunningGateway, **kwargs: Any) -> OpenAI:
    kwargs.setdefault("api_key", "unused")
    return OpenAI(base_url=gw.openai_base_url, max_retries=0, timeout=30, **kwargs)


def set_faults(url: str, **faults: Any) -> None:
    httpx.post(f"{url}/sim/faults", json=faults, timeout=5).raise_for_status()


def reset_faults(urls: Sequence[str]) -> None:
    for url in urls:
        set_faults(url, reset=True)


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for (sample, sample_labels), value in metric_samples(text).items():
        if sample == name and all(dict(sample_labels).get(k) == v for k, v in labels.items()):
            total += value
    return total


def chat(messages_text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": messages_text}]
