"""Hostile requests for the fuzz benchmark and the fuzz smoke test, and how their answers are judged.

Three families, all aimed at a gateway on 127.0.0.1:

- **bodies** (hypothesis): OpenAI request shapes for the three proxied endpoints where any
  field may have the wrong type, strings carry lone surrogates and control characters, and
  the serialized bytes may be made invalid UTF-8, truncated or spliced;
- **hostile** (fixed): nesting from 100 to 100,000 levels, bodies just under and over the
  size limit, token-id prompts past any context window, odd content types;
- **raw** (sockets): garbage bytes, unknown methods, broken request lines and headers, lying
  Content-Length, broken chunked encoding, oversized and overmany headers, HTTP/2 prefaces.

:class:`Tally` judges each answer: any 5xx, any error body that is not OpenAI's
``{"error": {"message", "type", "code"}}``, any request that got no answer at all.
"""

from __future__ import annotations

import json
import random
import socket
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

MODEL = "demo-model"
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}

# -- judging -----------------------------------------------------------------------------------


def is_openai_error(data: bytes) -> bool:
    try:
        body = json.loads(data)
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
        and "code" in error
    )


def is_shed(status: int, data: bytes, headers: Mapping[str, str] | None) -> bool:
    """A 503 the gateway means: a process-wide cap was full (``server_overloaded``) and the
    client is told when to retry (``retry-after``).  Any other 5xx is a failure."""
    if status != 503 or not headers or "retry-after" not in headers:
        return False
    try:
        error = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "server_overloaded"


@dataclass
class Tally:
    """What the gateway answered; every ``bad_*`` count must be 0.

    A 5xx is a failure (``bad_5xx``) — except a 503 ``server_overloaded`` with ``retry-after``:
    the gateway shedding load on purpose at ``server.max_concurrency`` or
    ``server.max_buffered_body_bytes``, counted apart in ``shed``.
    """

    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    bad_5xx: int = 0
    bad_shape: int = 0
    no_answer: int = 0
    shed: int = 0
    examples: list[str] = field(default_factory=list)  # the first few bad cases, for the report

    def _example(self, what: str) -> None:
        if len(self.examples) < 12:
            self.examples.append(what[:300])

    def judge(
        self,
        family: str,
        status: int | None,
        content_type: str,
        data: bytes,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """``headers``: lower-case names (a 503 without them cannot be told apart from a failure)."""
        self.sent += 1
        if status is None:
            self.no_answer += 1
            self._example(f"{family}: no answer")
            return
        self.statuses[status] += 1
        if is_shed(status, data, headers):
            self.shed += 1
        elif status >= 500:
            self.bad_5xx += 1
            self._example(f"{family}: {status} {data[:200]!r}")
        if status >= 400 and not is_openai_error(data):
            self.bad_shape += 1
            self._example(f"{family}: {status} not OpenAI-shaped: {content_type} {data[:200]!r}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "gateway_5xx": self.bad_5xx,
            "shed_503": self.shed,
            "non_openai_errors": self.bad_shape,
            "no_answer": self.no_answer,
            "examples": self.examples,
        }


# -- bodies (hypothesis) -----------------------------------------------------------------------
# every code point, lone surrogates and control characters included
any_char = st.characters(codec=None, exclude_categories=())
hostile_text = st.one_of(st.text(any_char, max_size=40), st.sampled_from(["", "\ud800", "a\udfffb", "\x00\n\r\u2028"]))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    hostile_text,
)
any_value = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(hostile_text, inner, max_size=4), max_leaves=12
)


def maybe(right: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the right type, sometimes anything at all."""
    return st.one_of(right, right, any_value)


part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": maybe(hostile_text)})
message = st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["user", "system", "assistant", "tool", "developer"]))},
    optional={
        "content": st.one_of(hostile_text, st.lists(part, max_size=3), any_value),
        "name": maybe(hostile_text),
        "tool_calls": any_value,
        "tool_call_id": maybe(hostile_text),
    },
)
common = {
    "model": st.one_of(st.just(MODEL), st.just(MODEL), hostile_text, any_value),
    "stream": maybe(st.booleans()),
    "stream_options": maybe(
        st.fixed_dictionaries({}, optional={"include_usage": maybe(st.booleans()), "continuous_usage_stats": any_value})
    ),
    "max_tokens": maybe(st.integers(-5, 64)),
    "n": st.one_of(st.integers(-2, 4), hostile_text, st.none()),
    "temperature": maybe(st.floats(0, 2)),
    "top_p": any_value,
    "cache_salt": maybe(hostile_text),
    "user": maybe(hostile_text),
    "extra": any_value,
}
prompt = st.one_of(hostile_text, st.lists(hostile_text, max_size=3), st.lists(st.integers(-5, 2**40), max_size=40))
bodies = {
    "chat": st.fixed_dictionaries(
        {}, optional={**common, "messages": maybe(st.lists(message, max_size=4)), "tools": any_value}
    ),
    "completions": st.fixed_dictionaries({}, optional={**common, "prompt": maybe(prompt), "echo": any_value}),
    "embeddings": st.fixed_dictionaries({}, optional={**common, "input": maybe(prompt)}),
}


# well-formed requests whose strings are hostile: these reach the prefix pipeline and a replica
valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": hostile_text},
    optional={"name": hostile_text},
)
valid_options = {
    "stream": st.booleans(),
    "max_tokens": st.integers(1, 16),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "cache_salt": hostile_text,
    "user": hostile_text,
}
valid_prompt = st.one_of(hostile_text, st.lists(st.integers(0, 50_000), min_size=1, max_size=40))
valid = {
    "chat": st.fixed_dictionaries(
        {"model": st.just(MODEL), "messages": st.lists(valid_message, min_size=1, max_size=4)}, optional=valid_options
    ),
    "completions": st.fixed_dictionaries({"model": st.just(MODEL), "prompt": valid_prompt}, optional=valid_options),
    "embeddings": st.fixed_dictionaries({"model": st.just(MODEL), "input": valid_prompt}),
}


@st.composite
def request_bytes(draw: st.DrawFn) -> tuple[str, bytes, str]:
    """(endpoint, body bytes, content type): JSON, raw UTF-8 with surrogates, or mangled."""
    endpoint = draw(st.sampled_from(sorted(bodies)))
    body = draw(st.one_of(valid[endpoint], bodies[endpoint], any_value))
    how = draw(st.sampled_from(["ascii"] * 6 + ["utf8", "utf8", "mangle", "truncate"]))
    try:
        data = json.dumps(body, ensure_ascii=how != "utf8", allow_nan=True).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        data = b"{}"
    if how == "mangle" and data:
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
    elif how == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    content_type = draw(
        st.sampled_from(["application/json"] * 6 + ["text/plain", "", "application/json; charset=latin-1"])
    )
    return endpoint, data, content_type


def post(client: httpx.Client, tally: Tally, family: str, path: str, data: bytes, content_type: str) -> None:
    headers = {"content-type": content_type} if content_type else {}
    try:
        with client.stream("POST", path, content=data, headers=headers) as response:
            body = response.read()
            tally.judge(family, response.status_code, response.headers.get("content-type", ""), body, response.headers)
    except httpx.HTTPError as exc:
        tally.judge(f"{family} ({type(exc).__name__})", None, "", b"")


def run_bodies(base_url: str, count: int, tally: Tally, seed: int = 0) -> None:
    """``count`` hypothesis-generated requests (generation only: nothing is shrunk or stored)."""
    with httpx.Client(base_url=base_url, timeout=60) as client:

        @settings(
            max_examples=count,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(request_bytes())
        def one(case: tuple[str, bytes, str]) -> None:
            endpoint, data, content_type = case
            post(client, tally, "body", PATHS[endpoint], data, content_type)

        random.seed(seed)
        one()


# -- hostile bodies (fixed) ------------------------------------------------------------------
def hostile_bodies(max_body_bytes: int) -> list[tuple[str, str, bytes]]:
    """(name, path, bytes): nesting, sizes, context overflows."""
    chat = PATHS["chat"]
    cases: list[tuple[str, str, bytes]] = []
    for depth in (100, 129, 500, 989, 990, 1000, 5000, 100_000):
        nested = "[" * depth + "]" * depth
        cases.append((f"nested list {depth}", chat, f'{{"model":"{MODEL}","messages":{nested}}}'.encode()))
        deep_dict = '{"a":' * depth + "1" + "}" * depth
        cases.append(
            (
                f"nested dict {depth} in content",
                chat,
                f'{{"model":"{MODEL}","messages":[{{"role":"user","content":{deep_dict}}}]}}'.encode(),
            )
        )
    near = max_body_bytes - 200
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * (near // 5 - 20)}]}).encode()
    cases.append(("just under the body limit", chat, big))
    cases.append(("over the body limit", chat, b" " * (max_body_bytes + 1)))
    cases.append(
        (
            "token ids past any window",
            PATHS["completions"],
            json.dumps({"model": MODEL, "prompt": list(range(200_000))}).encode(),
        )
    )
    cases.append(
        (
            "10k messages",
            chat,
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 10_000}).encode(),
        )
    )
    cases.append(
        (
            "surrogates everywhere",
            chat,
            b'{"model":"\\ud800","messages":[{"role":"\\udfff","content":"\\ud83d"}],"cache_salt":"\\udc00"}',
        )
    )
    cases.append(
        ("invalid utf-8", chat, b'{"model":"demo-model","messages":[{"role":"user","content":"\xff\xfe\xc0\xaf"}]}')
    )
    cases.append(("nul bytes", chat, b'{"model":"demo-model\x00","messages":[{"role":"user","content":"a\x00b"}]}'))
    cases.append(
        (
            "huge number",
            chat,
            b'{"model":"demo-model","messages":[{"role":"user","content":"x"}],"max_tokens":1' + b"0" * 5000 + b"}",
        )
    )
    cases.append(
        ("duplicate keys", chat, b'{"model":"a","model":"demo-model","messages":[{"role":"user","content":"x"}]}')
    )
    return cases


def run_hostile(base_url: str, max_body_bytes: int, tally: Tally, repeat: int = 1) -> None:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for _ in range(repeat):
            for name, path, data in hostile_bodies(max_body_bytes):
                post(client, tally, f"hostile {name}", path, data, "application/json")


# -- raw sockets -----------------------------------------------------------------------------
def req(line: bytes, *headers: bytes, body: bytes = b"") -> bytes:
    """A raw HTTP/1.1 request: ``line``, ``Host`` plus ``headers``, a blank line, ``body``."""
    return b"\r\n".join([line, b"Host: x", *headers]) + b"\r\n\r\n" + body


def raw_cases(rng: random.Random) -> list[tuple[str, bytes]]:
    body = b'{"model":"demo-model","messages":[{"role":"user","content":"hi"}]}'
    chat = b"POST /v1/chat/completions HTTP/1.1"
    ws = [b"Upgrade: websocket", b"Connection: Upgrade", b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="]
    fixed = [
        ("http2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        ("unknown method", req(b"FOO /v1/models HTTP/1.1")),
        ("lowercase method", req(b"get /health HTTP/1.1")),
        ("bad version", req(b"GET /health HTTP/7.1")),
        ("no version", b"GET /health\r\n\r\n"),
        ("absolute uri", req(b"GET http://evil.example/v1/models HTTP/1.1")),
        ("connect", req(b"CONNECT evil.example:443 HTTP/1.1")),
        ("space in header name", req(b"GET /health HTTP/1.1", b"Bad Header: 1")),
        ("header without colon", req(b"GET /health HTTP/1.1", b"nocolon")),
        ("nul in path", req(b"GET /v1/\x00models HTTP/1.1")),
        ("crlf in path", req(b"GET /v1/x%0D%0AX-Injected:%201 HTTP/1.1")),
        ("negative content-length", req(chat, b"Content-Length: -5")),
        ("two content-lengths", req(chat, b"Content-Length: 5", b"Content-Length: 7", body=body)),
        ("cl and chunked", req(chat, b"Content-Length: 5", b"Transfer-Encoding: chunked", body=b"0\r\n\r\n")),
        ("bad chunk size", req(chat, b"Transfer-Encoding: chunked", body=b"zz\r\nabc\r\n0\r\n\r\n")),
        ("huge chunk size", req(chat, b"Transfer-Encoding: chunked", body=b"ffffffffffffffffff\r\nabc\r\n")),
        ("content-length too long", req(chat, b"Content-Length: 999999999999", body=body)),
        ("content-length short", req(chat, b"Content-Type: application/json", b"Content-Length: 10", body=body)),
        ("huge header", req(b"GET /v1/models HTTP/1.1", b"Authorization: Bearer " + b"a" * 10_000_000)),
        ("20k headers", req(b"GET /health HTTP/1.1", *(b"X-%d: v" % i for i in range(20_000)))),
        ("websocket upgrade", req(b"GET /v1/models HTTP/1.1", *ws, b"Sec-WebSocket-Version: 13")),
        ("h2c upgrade", req(b"GET /health HTTP/1.1", b"Upgrade: h2c", b"Connection: Upgrade, HTTP2-Settings")),
        (
            "expect 100",
            req(
                chat,
                b"Expect: 100-continue",
                b"Content-Type: application/json",
                b"Content-Length: %d" % len(body),
                body=body,
            ),
        ),
        ("tls client hello", bytes.fromhex("16030100a5010000a10303") + bytes(rng.randrange(256) for _ in range(160))),
    ]
    methods = [b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"HEAD", b"TRACE", b"PROPFIND", b"XYZ"]
    generated = []
    for i in range(120):
        kind = i % 4
        if kind == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))) + b"\r\n\r\n"
        elif kind == 1:
            path = rng.choice([b"/", b"/v1/chat/completions", b"/v1/models", b"/admin/stats", b"/metrics", b"/docs"])
            data = rng.choice(methods) + b" " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
        elif kind == 2:
            line = bytearray(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            for _ in range(rng.randrange(1, 4)):
                line[rng.randrange(len(line))] = rng.randrange(256)
            data = bytes(line)
        else:
            data = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            data += b"Content-Length: %d\r\n\r\n" % len(body) + bytearray(rng.randrange(256) for _ in range(len(body)))
        generated.append((f"generated {kind}", data))
    return fixed + generated


def raw_exchange(host: str, port: int, data: bytes, timeout: float = 30.0, idle: float = 1.0) -> bytes | None:
    """Send ``data`` (the server may close early) and read the answer; None if nothing came back.

    The write side stays open (a half-close makes uvicorn drop the connection before a slow
    answer); the answer ends when the server closes or, once bytes arrived, after ``idle``
    seconds of silence (a kept-alive connection).
    """
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    with sock:
        try:
            for i in range(0, len(data), 65536):
                sock.sendall(data[i : i + 65536])
        except OSError:
            pass
        chunks: list[bytes] = []
        try:
            while True:
                sock.settimeout(timeout if not chunks else 0.05 if _complete(b"".join(chunks)) else idle)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError:  # reset, or the idle timeout after an answer
            pass
    return b"".join(chunks) or None


def _complete(answer: bytes) -> bool:
    """Whether ``answer`` ends with a whole HTTP response (then stop waiting for more)."""
    head, sep, body = answer.rpartition(b"\r\n\r\n") if answer.count(b"HTTP/1.") == 1 else (b"", b"", b"")
    if not sep or not head.startswith(b"HTTP/1."):
        return False
    lowered = head.lower()
    if b"transfer-encoding: chunked" in lowered:
        return body.endswith(b"0\r\n\r\n") or answer.endswith(b"0\r\n\r\n")
    for line in lowered.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return False


def judge_raw(tally: Tally, name: str, answer: bytes | None, head_request: bool = False) -> None:
    """Every HTTP answer on the connection (pipelined data can produce several) is judged."""
    if answer is None:
        tally.judge(f"raw {name}", None, "", b"")
        return
    rest = answer
    while rest.startswith(b"HTTP/1."):
        head, _, after = rest.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        try:
            status = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            tally.judge(f"raw {name} (bad status line)", None, "", b"")
            return
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
        if head_request:  # a response to HEAD has headers only, whatever they announce
            body, rest = b"", b""
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            # no body to check: the announced type must be JSON, as the GET's error body would be
            stand_in = b'{"error":{"message":"","type":"","code":null}}' if "json" in content_type else b""
            tally.judge(f"raw {name} (HEAD)", status, content_type, stand_in)
            continue
        if b"content-length" in headers:
            size = int(headers[b"content-length"])
            body, rest = after[:size], after[size:]
        elif headers.get(b"transfer-encoding") == b"chunked":
            body, rest = _dechunk(after)
        else:
            body, rest = after, b""
        if status == 100:
            continue
        text_headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers.items()}
        tally.judge(f"raw {name}", status, text_headers.get("content-type", ""), body, text_headers)
    if rest == answer:  # not HTTP at all
        tally.judge(f"raw {name} (not HTTP)", None, "", answer[:100])


def _dechunk(data: bytes) -> tuple[bytes, bytes]:
    out = []
    while True:
        line, _, data = data.partition(b"\r\n")
        try:
            size = int(line.split(b";")[0], 16)
        except ValueError:
            return b"".join(out), b""
        if size == 0:
            return b"".join(out), data.partition(b"\r\n")[2]
        out.append(data[:size])
        data = data[size + 2 :]


def run_raw(host: str, port: int, tally: Tally, seed: int = 0, repeat: int = 1) -> None:
    rng = random.Random(seed)
    for _ in range(repeat):
        for name, data in raw_cases(rng):
            judge_raw(tally, name, raw_exchange(host, port, data), head_request=data.startswith(b"HEAD "))


# -- slow partial requests -------------------------------------------------------------------
def run_slow(host: str, port: int, base_url: str, connections: int, deadline_s: float) -> dict[str, Any]:
    """Open ``connections`` half-sent requests (half stop in the head, half in the body); count
    how many the gateway closed within ``deadline_s`` and whether normal requests were served meanwhile."""
    socks = []
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    for i in range(connections):
        try:
            sock = socket.create_connection((host, port), timeout=5)
        except OSError:
            break
        sock.sendall(head[:30] if i % 2 == 0 else head + b'Content-Length: 1000\r\n\r\n{"model":')
        sock.setblocking(False)
        socks.append(sock)
    served = 0
    with httpx.Client(base_url=base_url, timeout=30) as client:
        for _ in range(20):
            response = client.post(
                PATHS["chat"], json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            )
            served += response.status_code == 200
    t0 = time.monotonic()
    open_socks = set(range(len(socks)))
    answered = Counter[str]()
    while open_socks and time.monotonic() - t0 < deadline_s:
        for i in list(open_socks):
            try:
                data = socks[i].recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                answered[data.split(b"\r\n", 1)[0].decode("latin-1")] += 1
                continue
            open_socks.discard(i)
        time.sleep(0.05)
    for sock in socks:
        sock.close()
    return {
        "opened": len(socks),
        "still_open_after_deadline": len(open_socks),
        "answers": dict(answered),
        "normal_requests_served_meanwhile": f"{served}/20",
        "deadline_s": deadline_s,
    }
