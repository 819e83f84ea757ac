"""Two agent workloads of issue 8 and issue 9 (chat endpoint, text prompts), built on ``agent.py``.

``agent_long`` — tenants whose shared head (system prompt + tool schemas) is *longer than the
old 4,096-token key window*: 6k-12k tokens.  Each tenant runs many conversations at once, each
resending a long, growing history.  Behind such a head every conversation of a tenant used to
get the same routing keys, so they piled onto one replica (issue 8, cause 1).  Nothing in it
is volatile: no normalization, the same prompts for every router.

``agent_toolloop`` — an agent's tool loop: a fresh timestamp and trace id on top of the
system prompt at every step, one user task, then assistant tool-call / tool-result steps (each
step resends everything before it).  Served with normalization ``relocate``.  Its workload also
carries a *reference*: the very same requests without the volatile header, which the pooled
oracle replays to give the hit rate a router could reach if the application had never put the
header there (issue 9: hit >= 98 % of that).

Both are seeded and deterministic; prompt sizes are counted in cl100k tokens with the same
chat template as ``agent.py`` (used only to size the offered load).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from benchmarks.workloads import BenchRequest, Workload
from benchmarks.workloads.agent import _EPOCH, _poisson_times
from benchmarks.workloads.text import words
from gateway.tokens.chat_template import GENERATION_PROMPT, render_message
from gateway.tokens.tokenizer import get_tokenizer

TOOL_NAMES = ("search_docs", "read_file", "run_query", "http_get", "create_ticket", "list_jobs", "get_metrics")


def tool_schemas(rng: random.Random, tokens: int) -> str:
    """A JSON list of function tools whose descriptions add up to about ``tokens`` tokens."""
    n = len(TOOL_NAMES)
    per_tool = max(1, tokens // n)
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": words(rng, per_tool - 24).strip(),
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                    "required": ["query"],
                },
            },
        }
        for name in TOOL_NAMES
    ]
    return json.dumps(tools, indent=1)


def shared_head(rng: random.Random, tenant: int, system_tokens: int, tool_tokens: int) -> str:
    """A tenant's fixed head: instructions, then the tool schemas it exposes."""
    return (
        f"You are the operations agent of tenant-{tenant:02d}. Follow the policies below.\n"
        f"{words(rng, system_tokens)}\n\n# Tools\n{tool_schemas(rng, tool_tokens)}\n"
    )


def trace_header(rng: random.Random, t: float) -> str:
    """What a tracing middleware stamps on top of every step: the time and a fresh trace id."""
    stamp = _EPOCH + timedelta(seconds=t, milliseconds=rng.randrange(1000))
    iso = stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return f"Current time: {iso}\nTrace ID: {rng.getrandbits(128):032x}\n\n"


class _PromptCounter:
    """``len(chat_tokens(...))`` with each rendered message counted once: the template's segments
    are token boundaries, and a conversation resends the same messages every turn (a 10k-token
    head would otherwise be tokenized again for every request)."""

    def __init__(self) -> None:
        self.tok = get_tokenizer("cl100k_base")
        self.counts: dict[str, int] = {}

    def __call__(self, messages: list[dict[str, Any]]) -> int:
        total = len(self.tok.encode(GENERATION_PROMPT))
        for message in messages:
            text = render_message(message)
            n = self.counts.get(text)
            if n is None:
                n = self.counts[text] = len(self.tok.encode(text))
            total += n
        return total


def _requests(drafts: list[tuple[float, list[dict[str, Any]], str, str, str]], max_tokens: int) -> list[BenchRequest]:
    """Drafts (time, messages, session, kind, header) -> requests sorted by time; the header (may be
    empty) goes on top of the system message."""
    count = _PromptCounter()
    out = []
    for t, messages, session, kind, header in sorted(drafts, key=lambda d: d[0]):
        system, *rest = messages
        sent = [{"role": "system", "content": header + system["content"]}, *rest]
        out.append(
            BenchRequest(
                t=t,
                endpoint="chat",
                body={"messages": sent},
                max_tokens=max_tokens,
                prompt_tokens=count(sent),
                session=session,
                kind=kind,
            )
        )
    return out


# -- agent_long -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LongHeadSpec:
    """Shape of ``agent_long``; token ranges are inclusive (uniform)."""

    tenants: int = 4
    system_tokens: tuple[int, int] = (3000, 6000)
    tool_tokens: tuple[int, int] = (3000, 6000)  # head = system + tools: 6k-12k tokens
    conversations: int = 64  # ~16 per tenant, several at once
    turns: tuple[int, int] = (3, 9)
    user_tokens: tuple[int, int] = (30, 200)
    tool_result_tokens: tuple[int, int] = (200, 1200)
    tool_share: float = 0.5
    assistant_tokens: tuple[int, int] = (30, 150)
    think_s: float = 8.0
    span_s: float = 120.0
    max_tokens: int = 16


def build_agent_long_workload(size: float = 1.0, seed: int = 0, spec: LongHeadSpec | None = None) -> Workload:
    """Tenants with a 6k-12k-token shared head and many long conversations each."""
    spec = spec or LongHeadSpec()
    rng = random.Random(f"agent_long:{seed}")
    heads = [
        shared_head(rng, i, rng.randint(*spec.system_tokens), rng.randint(*spec.tool_tokens))
        for i in range(spec.tenants)
    ]
    n_conv = max(2, round(spec.conversations * size))
    span = spec.span_s * max(size, 0.1)
    drafts: list[tuple[float, list[dict[str, Any]], str, str, str]] = []
    for c, start in enumerate(_poisson_times(rng, n_conv, span)):
        tenant = c % spec.tenants  # every tenant gets its share of concurrent conversations
        history: list[dict[str, Any]] = [{"role": "system", "content": heads[tenant]}]
        t = start
        for turn in range(rng.randint(*spec.turns)):
            if turn > 0:
                history.append({"role": "assistant", "content": words(rng, rng.randint(*spec.assistant_tokens))})
                t += rng.expovariate(1.0 / spec.think_s)
            if turn > 0 and rng.random() < spec.tool_share:
                content = "Observation from tool:" + words(rng, rng.randint(*spec.tool_result_tokens))
            else:
                content = words(rng, rng.randint(*spec.user_tokens))
            history.append({"role": "user", "content": content})
            drafts.append((t, list(history), f"t{tenant}-conv{c}", "turn", ""))
    return Workload(
        name="agent_long",
        description=(
            f"{spec.tenants} tenants, shared head (system + tool schemas) "
            f"{spec.system_tokens[0] + spec.tool_tokens[0]}-{spec.system_tokens[1] + spec.tool_tokens[1]} tokens, "
            f"{n_conv} conversations resending long histories, no volatile header"
        ),
        requests=_requests(drafts, spec.max_tokens),
        normalize="off",
        meta={"seed": seed, "conversations": n_conv, "max_tokens": spec.max_tokens},
    )


# -- agent_toolloop ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolLoopSpec:
    """Shape of ``agent_toolloop``; token ranges are inclusive (uniform)."""

    tenants: int = 4
    system_tokens: tuple[int, int] = (1500, 3000)
    tool_tokens: tuple[int, int] = (1000, 2000)
    loops: int = 48  # one user task each
    steps: tuple[int, int] = (4, 12)  # requests per loop: the task, then one per tool result
    task_tokens: tuple[int, int] = (50, 300)
    tool_result_tokens: tuple[int, int] = (200, 1500)
    step_s: float = 2.0  # mean tool execution time between steps (workload clock)
    span_s: float = 120.0
    max_tokens: int = 16


def _tool_call(rng: random.Random, loop: int, step: int) -> tuple[dict[str, Any], str]:
    call_id = f"call_{loop}_{step}"
    arguments = json.dumps({"query": words(rng, rng.randint(4, 12)).strip(), "limit": rng.randint(1, 50)})
    name = TOOL_NAMES[rng.randrange(len(TOOL_NAMES))]
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
    }
    return message, call_id


def build_agent_toolloop_workload(size: float = 1.0, seed: int = 0, spec: ToolLoopSpec | None = None) -> Workload:
    """Agent tool loops with a fresh timestamp + trace id on top at every step (plus the reference
    requests without that header)."""
    spec = spec or ToolLoopSpec()
    rng = random.Random(f"agent_toolloop:{seed}")
    heads = [
        shared_head(rng, i, rng.randint(*spec.system_tokens), rng.randint(*spec.tool_tokens))
        for i in range(spec.tenants)
    ]
    n_loops = max(2, round(spec.loops * size))
    span = spec.span_s * max(size, 0.1)
    drafts: list[tuple[float, list[dict[str, Any]], str, str, str]] = []
    for loop, start in enumerate(_poisson_times(rng, n_loops, span)):
        tenant = loop % spec.tenants
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": heads[tenant]},
            {"role": "user", "content": "Task:" + words(rng, rng.randint(*spec.task_tokens))},
        ]
        t = start
        for step in range(rng.randint(*spec.steps)):
            if step > 0:
                call, call_id = _tool_call(rng, loop, step)
                result = "Result:" + words(rng, rng.randint(*spec.tool_result_tokens))
                messages += [call, {"role": "tool", "tool_call_id": call_id, "content": result}]
                t += rng.expovariate(1.0 / spec.step_s)
            drafts.append((t, list(messages), f"t{tenant}-loop{loop}", "step", trace_header(rng, t)))
    requests = _requests(drafts, spec.max_tokens)
    reference = _requests([(t, m, s, k, "") for t, m, s, k, _ in drafts], spec.max_tokens)
    return Workload(
        name="agent_toolloop",
        description=(
            f"{spec.tenants} tenants' agent tool loops ({n_loops} tasks, {spec.steps[0]}-{spec.steps[1]} steps): "
            "a fresh timestamp + trace id on top of the system prompt every step, tool-call / tool-result history"
        ),
        requests=requests,
        normalize="relocate",
        meta={"seed": seed, "loops": n_loops, "max_tokens": spec.max_tokens},
        reference=reference,
    )
