"""Planted traffic for the doctor tests, and the gateway + replicas it runs through.

The sample has four planted causes of misses: a timestamp leading the system prompt, a
per-request UUID inside a tool description, prompts shorter than a block, and per-tenant
cache salts.  Each request is an OpenAI chat body; the same list is sent through a gateway
with the OpenAI SDK and written to a JSONL file.
"""

from __future__ import annotations

import contextlib
import json
import random
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml
from openai import OpenAI

from gateway.http.server import RunningGateway, serve_in_thread
from tests.configs import gateway_config

MODEL = "demo-model"
ADMIN_KEY = "doctor-admin-key"
QUESTIONS = [
    "Where is my order?",
    "Can I change the delivery address?",
    "How do I return a broken kettle?",
    "Is express shipping available to Oslo?",
    "What is your refund policy for sale items?",
]
INSTRUCTIONS = (
    "You are the support assistant of the ACME online shop. Answer politely, briefly and precisely. "
    "Use the lookup_order tool for anything about a specific order, never guess an order's status. "
) + " ".join(f"Policy {i}: items of category {i} may be returned within {10 + i} days of delivery." for i in range(40))
LOOKUP_PARAMETERS = {
    "type": "object",
    "properties": {"order_id": {"type": "string", "description": "the order number"}},
    "required": ["order_id"],
}


WORDS = ["kite", "lamp", "river", "stone", "maple", "cloud", "ember", "frost", "grove", "harbor"]


def _timestamp(i: int) -> str:
    return f"2025-03-04T05:{i // 60 % 60:02d}:{i % 60:02d}Z"


def planted_traffic(n: int = 30, seed: int = 7, unknown_id: bool = False) -> list[dict[str, Any]]:
    """``n`` chat bodies: a timestamp on top, a UUID in the tool description, every 6th one a
    prompt shorter than a block, and the rest salted per tenant (two tenants).

    ``unknown_id`` adds a session code no detector knows (``kite-maple-42``) to the system prompt.
    """
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        if i % 6 == 5:
            # a completion a few tokens long (any chat prompt is longer than a block: the template's markers)
            bodies.append({"model": MODEL, "prompt": "Say hi.", "max_tokens": 4})
            continue
        trace = uuid.UUID(int=rng.getrandbits(128), version=4)
        system = f"Current time: {_timestamp(i)}\n"
        if unknown_id:  # a session code in a format no detector knows: two words and a number
            system += f"Session code: {rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randrange(10, 99)}.\n"
        tool = {
            "type": "function",
            "function": {
                "name": "lookup_order",
                "description": f"Look up an order (trace {trace}). Returns its status and delivery estimate.",
                "parameters": LOOKUP_PARAMETERS,
            },
        }
        bodies.append(
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": system + INSTRUCTIONS},
                    {"role": "user", "content": rng.choice(QUESTIONS)},
                ],
                "tools": [tool],
                "cache_salt": "tenant-a" if i % 2 else "tenant-b",
                "max_tokens": 4,
            }
        )
    return bodies


def write_jsonl(path: Path, bodies: Sequence[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(body) + "\n" for body in bodies))
    return path


def route(mode: str = "report", **normalize: Any) -> dict[str, Any]:
    return {"name": "main", "match": {"models": [MODEL]}, "policy": "prefix", "normalize": {"mode": mode, **normalize}}


def write_config(path: Path, urls: Sequence[str], routes: list[dict[str, Any]]) -> Path:
    """A config file with these routes (for ``doctor --file --config``)."""
    data = {
        "replicas": [{"name": f"r{i}", "url": url} for i, url in enumerate(urls)],
        "routes": routes,
    }
    path.write_text(yaml.safe_dump(data))
    return path


def apply_patch(route_config: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A route config with a doctor fix's ``patch`` merged in (sections merge one level deep)."""
    out = dict(route_config)
    for key, value in patch.items():
        if key == "route":
            continue
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


@contextlib.contextmanager
def gateway(urls: Sequence[str], routes: list[dict[str, Any]], **overrides: Any) -> Iterator[RunningGateway]:
    with serve_in_thread(gateway_config(urls, routes=routes, **overrides)) as gw:
        yield gw


def send(gw: RunningGateway, bodies: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """Send every body with the OpenAI SDK, one after another; (prompt tokens, cached tokens) reported."""
    sdk = OpenAI(base_url=gw.openai_base_url, api_key="unused", max_retries=0, timeout=30)
    prompt = cached = 0
    for body in bodies:
        if "prompt" in body:
            done = sdk.completions.create(model=body["model"], prompt=body["prompt"], max_tokens=body["max_tokens"])
            assert done.usage is not None
            details = done.usage.prompt_tokens_details
            prompt += done.usage.prompt_tokens
            cached += (details.cached_tokens or 0) if details else 0
            continue
        extra = {k: v for k, v in body.items() if k not in ("model", "messages", "tools", "max_tokens")}
        reply = sdk.chat.completions.create(
            model=body["model"],
            messages=body["messages"],
            max_tokens=body["max_tokens"],
            extra_body=extra or None,
            **({"tools": body["tools"]} if "tools" in body else {}),
        )
        assert reply.usage is not None
        details = reply.usage.prompt_tokens_details
        prompt += reply.usage.prompt_tokens
        cached += (details.cached_tokens or 0) if details else 0
    return prompt, cached


def admin(gw: RunningGateway, key: str | None = ADMIN_KEY) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=gw.url, headers=headers, timeout=30)


def finding(report: dict[str, Any], cause: str) -> dict[str, Any]:
    matches = [f for f in report["findings"] if f["cause"] == cause]
    assert matches, f"doctor did not name {cause}: {[f['cause'] for f in report['findings']]}"
    return matches[0]
