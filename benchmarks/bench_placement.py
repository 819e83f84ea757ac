"""Where should relocated values go?  Measured reuse of each placement (issue 9, item 3).

    python benchmarks/bench_placement.py

For each placement, successive requests of three workloads are normalized (``relocate``,
values moved on first sight) and tokenized with the chat template the simulator and the
gateway share; the score is the share of step k's 16-token blocks that step k+1 shares
(what a prefix cache can reuse), averaged over steps 3..10:

- ``tool_loop``: fresh timestamp + trace id on top of a ~2,000-token system prompt, one user
  task, then assistant tool-call / tool-result steps (the agent loop of the issue).
- ``conversation``: the same system prompt, then user/assistant turns (the client resends
  its original history).
- ``completions``: a dated header on a ~2,000-token prompt, a new question each time
  (``completion_placement``: ``after_span_line`` vs ``end``).

Results: a table on stdout and ``benchmarks/results/bench_placement.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.prefix.normalize import Normalizer
from gateway.prefix.settings import NormalizeSettings
from gateway.tokens.chat_template import chat_tokens
from gateway.tokens.tokenizer import get_tokenizer

BLOCK = 16
STEPS = 10
SYSTEM = "You are an agent that uses tools carefully and reports what you did. " * 150
RESULT = "Rows: " + "alpha beta gamma delta epsilon " * 25


def header(k: int) -> str:
    return f"Current time: 2025-03-04T05:06:{k:02d}Z. Trace 4bf92f3577b34da6a3ce929d0e0e{k:04d}.\n"


def tool_loop(k: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": header(k) + SYSTEM},
        {"role": "user", "content": "Find the three largest customers and summarize their orders."},
    ]
    for i in range(k):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "query", "arguments": f'{{"page": {i}}}'}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"{RESULT} page {i}"},
        ]
    return messages


def conversation(k: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": header(k) + SYSTEM}]
    for i in range(k):
        messages.append({"role": "user", "content": f"Question {i}: what about region {i}?"})
        if i < k - 1:
            messages.append({"role": "assistant", "content": f"Region {i} grew. " * 20})
    return messages


def shared_share(prev: list[int], cur: list[int]) -> float:
    n = 0
    for a, b in zip(prev, cur, strict=False):
        if a != b:
            break
        n += 1
    return (n // BLOCK) / max(1, len(prev) // BLOCK)


def chat_reuse(placement: str, workload: Any) -> float:
    norm = Normalizer(NormalizeSettings(mode="relocate", always=["*"], placement=placement))  # type: ignore[arg-type]
    tok = get_tokenizer()
    prev: list[int] | None = None
    shares = []
    for k in range(1, STEPS + 1):
        body = norm.apply("chat", {"model": "m", "messages": workload(k)}).body
        tokens = list(chat_tokens(tok, body["messages"], add_generation_prompt=True))
        if prev is not None and k >= 3:
            shares.append(shared_share(prev, tokens))
        prev = tokens
    return sum(shares) / len(shares)


def completion_reuse(placement: str) -> float:
    settings = NormalizeSettings(mode="relocate", always=["*"], completion_placement=placement)  # type: ignore[arg-type]
    norm = Normalizer(settings)
    tok = get_tokenizer()
    prev: list[int] | None = None
    shares = []
    for k in range(1, STEPS + 1):
        prompt = norm.apply("completions", {"model": "m", "prompt": header(k) + SYSTEM + f"\nQ{k}: hi?\nA:"}).body
        tokens = tok.encode(prompt["prompt"])
        if prev is not None and k >= 3:
            shares.append(shared_share(prev, tokens))
        prev = tokens
    return sum(shares) / len(shares)


def main() -> None:
    rows: list[dict[str, Any]] = []
    for placement in ("end", "trailing_system", "last_user", "system_before_last_user"):
        rows.append(
            {
                "placement": placement,
                "tool_loop": round(chat_reuse(placement, tool_loop), 3),
                "conversation": round(chat_reuse(placement, conversation), 3),
            }
        )
    completions = {p: round(completion_reuse(p), 3) for p in ("end", "after_span_line")}
    print(f"{'placement':<26}{'tool_loop':>10}{'conversation':>14}")
    for row in rows:
        print(f"{row['placement']:<26}{row['tool_loop']:>10.3f}{row['conversation']:>14.3f}")
    print("completions: " + ", ".join(f"{k}={v:.3f}" for k, v in completions.items()))
    out = Path(__file__).parent / "results" / "bench_placement.json"
    out.write_text(json.dumps({"chat": rows, "completions": completions, "steps": STEPS}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
