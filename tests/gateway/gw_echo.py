"""An upstream that echoes what it received (for pass-through tests): a real server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

from gateway.http.server import bind_socket


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    if scope["path"] == "/health":
        payload: Any = {}
    elif scope["path"] == "/v1/models":
        payload = {"object": "list", "data": [{"id": "demo-model", "object": "model"}]}
    else:
        body = json.loads(b"".join(chunks) or b"{}")
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        payload = {
            "id": "echo",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "echo"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "echo": {"body": body, "headers": headers},
        }
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": data})


@contextlib.contextmanager
def run_echo() -> Iterator[str]:
    import threading
    import time

    import uvicorn

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    access = logging.getLogger("uvicorn.access")
    saved = (list(access.handlers), access.propagate)  # access_log=False would silence it process-wide
    server = uvicorn.Server(uvicorn.Config(echo_app, log_config=None, access_log=False, lifespan="off"))
    access.handlers[:], access.propagate = saved
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "echo server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)
