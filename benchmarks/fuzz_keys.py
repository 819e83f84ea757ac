"""The many spellings of one API key, and rotating made-up tokens, for the fuzz benchmark.

Issue 25 (item 2): auth accepts any case of ``Bearer`` and any spacing, and the per-key
limits keyed on the raw header, so one key could spell itself into many rate-limit buckets;
with auth off, every made-up token was a bucket of its own.  This family sends each spelling
of one valid key, odd ones included (tabs, trailing and leading blanks, no scheme, another
scheme), and a stream of never-repeated tokens, on raw sockets (an HTTP client would refuse
to send some of these header values).  Judged like every family — no 5xx but the intended
503 sheds, every error in OpenAI's shape, every request answered — and the statuses per
spelling are reported, so a spelling that auth treats differently from its siblings shows.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

from benchmarks.fuzz_cases import MODEL, Tally, judge_raw, raw_exchange

#: name → Authorization value (``{k}``: the key)
SPELLINGS = {
    "Bearer": "Bearer {k}",
    "bearer": "bearer {k}",
    "BEARER": "BEARER {k}",
    "bEaReR": "bEaReR {k}",
    "two spaces": "Bearer  {k}",
    "eight spaces": "Bearer        {k}",
    "space, tab": "Bearer \t{k}",
    "tab only": "Bearer\t{k}",
    "trailing spaces": "Bearer {k}   ",
    "trailing tab": "Bearer {k}\t",
    "leading space": " Bearer {k}",
    "no scheme": "{k}",
    "Basic scheme": "Basic {k}",
}

_BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


def keyed_request(authorization: str) -> bytes:
    """A small chat request carrying ``authorization``; ``Connection: close`` ends the answer at once."""
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: {authorization}\r\nContent-Length: {len(_BODY)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + _BODY


def _status(answer: bytes | None) -> str:
    if not answer or not answer.startswith(b"HTTP/1."):
        return "none"
    return answer.split(b" ", 2)[1].decode("latin-1")


def run_keys(
    host: str, port: int, key: str, tally: Tally, rounds: int = 10, tokens: int = 300, seed: int = 0
) -> dict[str, Any]:
    """Each spelling of ``key`` ``rounds`` times, then ``tokens`` made-up ones; statuses per spelling."""
    per_spelling: dict[str, Counter[str]] = {name: Counter() for name in SPELLINGS}
    made_up: Counter[str] = Counter()
    for _ in range(rounds):
        for name, template in SPELLINGS.items():
            answer = raw_exchange(host, port, keyed_request(template.format(k=key)))
            judge_raw(tally, f"key {name}", answer)
            per_spelling[name][_status(answer)] += 1
    rng = random.Random(seed)
    for _ in range(tokens):
        token = "sk-" + rng.randbytes(16).hex()
        answer = raw_exchange(host, port, keyed_request(f"{rng.choice(['Bearer', 'bearer'])} {token}"))
        judge_raw(tally, "key made-up token", answer)
        made_up[_status(answer)] += 1
    return {
        "spellings": {name: dict(sorted(c.items())) for name, c in per_spelling.items()},
        "made_up_tokens": dict(sorted(made_up.items())),
    }
