"""A scriptable upstream for the hardening tests: a real server on 127.0.0.1 (in a thread).

Its behaviour is picked by the request's ``model`` (chat) so one server covers every case:

- ``redirect``: a bare ``307`` with a ``Location`` and an empty body (a misconfigured replica)
- ``crlf-stream``: an SSE stream with CRLF line endings whose first chunk ends in ``\\r``
- ``linger-after-done``: an SSE stream (a chunk, a usage chunk with ``cached_tokens``, ``[DONE]``)
  whose connection stays open ``sleep_s`` seconds after ``[DONE]`` (a client that stops at
  ``[DONE]``, as the official SDKs do, closes first)
- ``slow``: the echo, after ``sleep_s`` seconds (default 1; holds a request in flight)
- anything else: an echo of the body and headers it received (like ``tests/gateway/gw_echo``)

``GET /v1/models`` answers only with ``Authorization: Bearer <api_key>`` when ``api_key`` is
set (like vLLM started with ``--api-key``) and lists ``max_model_len``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from gateway.http.server import bind_socket

MODEL = "demo-model"


def make_app(api_key: str | None, max_model_len: int, seen: list[dict[str, Any]], models: list[str]) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        seen.append({"path": scope["path"], "headers": headers})

        async def answer(status: int, payload: Any, extra: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
            data = b"" if payload is None else json.dumps(payload).encode()
            hdrs = [(b"content-length", str(len(data)).encode()), *extra]
            if payload is not None:
                hdrs.append((b"content-type", b"application/json"))
            await send({"type": "http.response.start", "status": status, "headers": hdrs})
            await send({"type": "http.response.body", "body": data})

        if scope["path"] == "/health":
            await answer(200, {})
            return
        if scope["path"] == "/metrics":
            await answer(404, None)
            return
        if scope["path"] == "/v1/models":
            if api_key is not None and headers.get("authorization") != f"Bearer {api_key}":
                await answer(401, {"error": {"message": "bad key", "type": "invalid_request_error", "code": "401"}})
                return
            cards = [{"id": m, "object": "model", "owned_by": "test", "max_model_len": max_model_len} for m in models]
            await answer(200, {"object": "list", "data": cards})
            return
        body = json.loads(b"".join(chunks) or b"{}")
        model = body.get("model")
        if model == "slow":
            await asyncio.sleep(float(body.get("sleep_s", 1.0)))
        if model == "redirect":
            await answer(307, None, [(b"location", b"http://10.255.255.1/v1/chat/completions")])
            return
        if model == "crlf-stream":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": model}
            first = {
                **base,
                "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}],
                "usage": None,
            }
            usage = {**base, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}}
            wire = b"data: " + json.dumps(first, separators=(",", ":")).encode() + b"\r\n\r\n"
            cut = wire.index(b"\r\n\r\n") + 1  # the first chunk ends in "\r"
            rest = wire[cut:] + b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\r\n\r\n"
            rest += b"data: [DONE]\r\n\r\n"
            await send({"type": "http.response.body", "body": wire[:cut], "more_body": True})
            await asyncio.sleep(0.05)  # two TCP reads at the gateway, not one
            await send({"type": "http.response.body", "body": rest, "more_body": False})
            return
        if model == "linger-after-done":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": model}
            first = {**base, "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
            counts = {"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301}
            usage = {**base, "choices": [], "usage": {**counts, "prompt_tokens_details": {"cached_tokens": 256}}}
            wire = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in (first, usage))
            await send({"type": "http.response.body", "body": wire + b"data: [DONE]\n\n", "more_body": True})
            await asyncio.sleep(float(body.get("sleep_s", 2.0)))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        payload = {
            "id": "echo",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "echo"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "echo": {"body": body, "headers": headers},
        }
        await answer(200, payload)

    return app


@contextlib.contextmanager
def run_upstream(
    api_key: str | None = None, max_model_len: int = 4096, models: tuple[str, ...] = (MODEL,)
) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Serve the scripted upstream; yields its base URL and the list of requests it saw."""
    seen: list[dict[str, Any]] = []
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    access = logging.getLogger("uvicorn.access")
    saved = (list(access.handlers), access.propagate)  # access_log=False would silence it process-wide
    app = make_app(api_key, max_model_len, seen, list(models))
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    access.handlers[:], access.propagate = saved
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "upstream did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.should_exit = True
        thread.join(5)
