"""Shared helpers for the gateway tests: configs, polling with deadlines, sim admin calls."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.http.server import RunningGateway, serve_in_thread
from tests.configs import gateway_config
from tests.polling import wait_for  # noqa: F401  (re-exported to the tests)
from tests.sdk import openai_client

MODEL = "demo-model"
T = TypeVar("T")


@contextlib.contextmanager
def running_gateway(urls: Sequence[str], **overrides: Any) -> Iterator[RunningGateway]:
    with serve_in_thread(gateway_config(urls, **overrides)) as gw:
        yield gw


def client(gw: RunningGateway, **kwargs: Any) -> OpenAI:
    kwargs.setdefault("api_key", "unused")
    return openai_client(gw.openai_base_url, timeout=30, **kwargs)


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
