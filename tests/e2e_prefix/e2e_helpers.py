"""Helpers for the prefix-routing end-to-end tests: configs, clients, conversations, metrics."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig
from gateway.http.server import RunningGateway, serve_in_thread
from gateway.tokens.chat_template import chat_tokens
from gateway.tokens.tokenizer import get_tokenizer
from tests.configs import gateway_config
from tests.polling import wait_for as _wait_for
from tests.sdk import openai_client

MODEL = "demo-model"
BLOCK = 16
ADMIN_KEY = "e2e-admin-key"
T = TypeVar("T")

# The simulated fleet of these tests (conftest.py's ``fleet``).
SIM_OPTIONS = {
    # The replicas use the ChatML-like layout over cl100k_base, which is also what the gateway
    # uses for an unknown model name (demo-model): these tests assert exact predictions.
    # test_e2e_alignment.py runs the misaligned and model-aligned cases.
    "tokenizer": "cl100k_base",
    "time_scale": 0,
    "enable_admin": True,
    "num_gpu_blocks": 4096,
    "max_output_tokens": 8,
    "disable_uvicorn_access_log": True,
    "disable_log_stats": True,
}


def prefix_route(name: str = "main", mode: str = "relocate", **extra: Any) -> dict[str, Any]:
    return {"name": name, "match": {"models": [MODEL]}, "policy": "prefix", "normalize": {"mode": mode}, **extra}


def config(urls: Sequence[str], routes: list[dict[str, Any]] | None = None, **overrides: Any) -> GatewayConfig:
    """The shared test config with prefix routes (default: one ``relocate`` route)."""
    return gateway_config(urls, routes=routes or [prefix_route()], **overrides)


@contextlib.contextmanager
def gateway(
    urls: Sequence[str], routes: list[dict[str, Any]] | None = None, **overrides: Any
) -> Iterator[RunningGateway]:
    with serve_in_thread(config(urls, routes, **overrides)) as gw:
        yield gw


def client(gw: RunningGateway, **headers: str) -> OpenAI:
    return openai_client(gw.openai_base_url, api_key="unused", timeout=30, default_headers=headers)


def admin(gw: RunningGateway, key: str = ADMIN_KEY) -> httpx.Client:
    return httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def wait_for(check: Callable[[], T], timeout: float = 15.0, interval: float = 0.02, what: str = "condition") -> T:
    """The shared poller with this suite's longer default deadline (4 fresh replicas per test)."""
    return _wait_for(check, timeout, interval, what)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def prompt_tokens_of(messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> int:
    """Tokens of ``messages`` in the ChatML-like layout over cl100k_base (the fleet's and the gateway's here)."""
    return len(chat_tokens(get_tokenizer(), messages, add_generation_prompt=add_generation_prompt))


def whole_blocks(tokens: int) -> int:
    return tokens // BLOCK * BLOCK


@dataclass
class Reply:
    replica: str
    route: str
    prompt_tokens: int
    cached_tokens: int | None
    content: str
    headers: httpx.Headers


def ask(sdk: OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Reply:
    """One chat completion through the gateway; where it went and what the usage said."""
    kwargs.setdefault("max_tokens", 8)
    raw = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=messages, **kwargs)
    reply = raw.parse()
    details = reply.usage.prompt_tokens_details
    return Reply(
        replica=raw.headers["x-prefix-gateway-replica"],
        route=raw.headers["x-prefix-gateway-route"],
        prompt_tokens=reply.usage.prompt_tokens,
        cached_tokens=None if details is None else details.cached_tokens,
        content=reply.choices[0].message.content or "",
        headers=raw.headers,
    )


@dataclass
class Conversation:
    """A multi-turn chat that resends its whole history every turn, like a real client."""

    topic: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.messages:
            persona = (
                f"You are the assistant for the {self.topic} desk. " + f"Answer {self.topic} questions well. " * 30
            )
            self.messages = [{"role": "system", "content": persona}]

    def turn(self, sdk: OpenAI, question: str) -> Reply:
        self.messages.append({"role": "user", "content": f"{question} (about {self.topic})"})
        reply = ask(sdk, self.messages)
        self.messages.append({"role": "assistant", "content": reply.content})
        self.replies.append(reply)
        return reply
