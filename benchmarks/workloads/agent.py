"""Synthetic multi-tenant agent workload (chat endpoint, text prompts).

What it models, from the operator story behind the product: an agent service where each
tenant has a long fixed system prompt, but the application stamps the *top* of that system
prompt with the current time and a request id.  Without normalization no two requests share
even their first 16-token block, so prefix caching "does not work"; with the gateway's
``relocate`` mode the volatile lines move after the last user message and every request of a
tenant shares the whole system prompt.

Traffic, all seeded and deterministic:

- ``tenants`` tenants, each with its own system prompt of ``system_tokens`` tokens headed by
  ``Current time: <ISO-8601 with ms>`` and ``Request ID: <UUID4>`` (new values per request);
- multi-turn conversations (Poisson starts) that resend their growing history every turn:
  user messages, tool observations (long) and the assistant's earlier replies;
- one-off requests: a single question to a tenant's agent (shares only the system prompt),
  and a share of fully unique requests (own system prompt, nothing shared).

The replay is open-loop: turn k+1 is sent at its scheduled time whether or not turn k has
finished (think times are long compared with moderate-load latencies).
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from benchmarks.workloads import BenchRequest, Workload
from benchmarks.workloads.text import words
from gateway.tokens.chat_template import chat_tokens
from gateway.tokens.tokenizer import get_tokenizer

_EPOCH = datetime(2025, 6, 2, 9, 0, 0, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """Shape of the agent workload; token ranges are inclusive (uniform)."""

    tenants: int = 6
    system_tokens: tuple[int, int] = (1500, 3500)
    conversations: int = 56
    turns: tuple[int, int] = (2, 8)
    user_tokens: tuple[int, int] = (30, 200)
    tool_tokens: tuple[int, int] = (200, 1200)
    tool_share: float = 0.5  # share of turns whose new input is a long tool observation
    assistant_tokens: tuple[int, int] = (30, 150)
    think_s: float = 8.0  # mean gap between a conversation's turns (workload clock)
    span_s: float = 120.0  # conversation starts and one-offs arrive over this span
    oneoffs: int = 60
    unique_share: float = 0.35  # share of one-offs with a private system prompt
    max_tokens: int = 16


def volatile_header(rng: random.Random, when: datetime) -> str:
    """The lines an application stamps at the top of its system prompt: new every request."""
    stamp = when + timedelta(milliseconds=rng.randrange(1000))
    request_id = uuid.UUID(int=rng.getrandbits(128), version=4)
    iso = stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return f"Current time: {iso}\nRequest ID: {request_id}\n\n"


def _tenant_prompts(rng: random.Random, spec: AgentSpec) -> list[str]:
    prompts = []
    for i in range(spec.tenants):
        name = f"tenant-{i:02d}"
        body = words(rng, rng.randint(*spec.system_tokens))
        prompts.append(f"You are the operations agent of {name}. Follow the policies below.\n{body}\n")
    return prompts


def _poisson_times(rng: random.Random, n: int, span: float) -> list[float]:
    """``n`` arrival times of a Poisson process conditioned to fall in [0, span): sorted uniforms."""
    return sorted(rng.uniform(0.0, span) for _ in range(n))


def build_agent_workload(size: float = 1.0, seed: int = 0, spec: AgentSpec | None = None) -> Workload:
    """Build the agent workload; ``size`` scales conversations, one-offs and the span together."""
    spec = spec or AgentSpec()
    rng = random.Random(f"agent:{seed}")
    n_conv = max(2, round(spec.conversations * size))
    n_oneoff = max(1, round(spec.oneoffs * size))
    span = spec.span_s * max(size, 0.1)
    tenants = _tenant_prompts(rng, spec)
    tok = get_tokenizer("cl100k_base")
    # (arrival, history after the system message, system prompt, session id, kind)
    drafts: list[tuple[float, list[dict[str, str]], str, str, str]] = []

    for c, start in enumerate(_poisson_times(rng, n_conv, span)):
        tenant = rng.randrange(spec.tenants)
        history: list[dict[str, str]] = []
        t = start
        for turn in range(rng.randint(*spec.turns)):
            if turn > 0:
                history.append({"role": "assistant", "content": words(rng, rng.randint(*spec.assistant_tokens))})
                t += rng.expovariate(1.0 / spec.think_s)
            if turn > 0 and rng.random() < spec.tool_share:
                content = "Observation from tool:" + words(rng, rng.randint(*spec.tool_tokens))
            else:
                content = words(rng, rng.randint(*spec.user_tokens))
            history.append({"role": "user", "content": content})
            drafts.append((t, list(history), tenants[tenant], f"t{tenant}-conv{c}", "turn"))

    for o, t in enumerate(_poisson_times(rng, n_oneoff, span)):
        question = [{"role": "user", "content": words(rng, rng.randint(*spec.user_tokens))}]
        if rng.random() < spec.unique_share:
            private = f"You are a one-off helper.\n{words(rng, rng.randint(*spec.system_tokens))}\n"
            drafts.append((t, question, private, f"oneoff-{o}", "unique"))
        else:
            drafts.append((t, question, tenants[rng.randrange(spec.tenants)], f"oneoff-{o}", "oneoff"))

    drafts.sort(key=lambda d: d[0])
    requests: list[BenchRequest] = []
    for t, history, system, session, kind in drafts:
        header = volatile_header(rng, _EPOCH + timedelta(seconds=t))
        messages = [{"role": "system", "content": header + system}, *history]
        requests.append(
            BenchRequest(
                t=t,
                endpoint="chat",
                body={"messages": messages},
                max_tokens=spec.max_tokens,
                prompt_tokens=len(chat_tokens(tok, messages)),
                session=session,
                kind=kind,
            )
        )
    return Workload(
        name="agent",
        description=(
            f"{spec.tenants} tenants' agents: system prompts {spec.system_tokens[0]}-{spec.system_tokens[1]} tokens "
            "with a timestamp + request id at the top, multi-turn conversations resending history, one-offs"
        ),
        requests=requests,
        normalize="relocate",
        meta={"seed": seed, "conversations": n_conv, "oneoffs": n_oneoff, "max_tokens": spec.max_tokens},
    )
