"""Process-wide caps: requests in flight and request-body bytes held (issue 25, item 3).

Slow uploads are raw sockets that send a request head (and maybe part of the body) and stop:
each holds a request in flight, and its declared Content-Length (or the chunks sent so far)
against the body-bytes cap.  Beyond a cap the gateway answers 503 ``server_overloaded`` with
``retry-after`` — what an SDK client sees is checked with the openai SDK — while probes,
metrics and admin keep answering; every slot and byte comes back when an upload ends,
however it ends (closed by the client, timed out, shed).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import openai
import pytest

from gateway.config import ConfigError, parse_config, sha256_hex
from gateway.http.server import RunningGateway, serve_in_thread
from gateway.service import live_config
from tests.configs import gateway_config
from tests.polling import wait_for
from tests.sdk import openai_client

MODEL = "demo-model"
ADMIN_KEY = "capacity-admin"
MAX_BODY = 16 * 1024
CAPS = {"max_concurrency": 3, "max_body_bytes": MAX_BODY, "max_buffered_body_bytes": 40_000}
MESSAGES = [{"role": "user", "content": "hi"}]


def _config(sim_url: str, **server: float) -> object:
    return gateway_config(
        [sim_url],
        server={"port": 0, **CAPS, **server},
        admin={"api_key_sha256": sha256_hex(ADMIN_KEY)},
    )


@pytest.fixture(scope="module")
def gw(sim_url: str) -> Iterator[RunningGateway]:
    with serve_in_thread(_config(sim_url, body_timeout_s=60.0)) as running:  # type: ignore[arg-type]
        yield running


def _open(gw: RunningGateway, head: bytes, body: bytes = b"") -> socket.socket:
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(head + body)
    return sock


def _slow_upload(gw: RunningGateway, declared: int, sent: bytes = b'{"model":') -> socket.socket:
    """A chat request whose head declares ``declared`` body bytes, of which only ``sent`` arrive."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % declared
    )
    return _open(gw, head, sent)


def _answer(sock: socket.socket) -> tuple[int, dict[bytes, bytes], dict[str, object]]:
    """The first answer on ``sock``: status, headers, the JSON body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
    size = int(headers[b"content-length"])
    while len(body) < size:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split(b" ", 2)[1]), headers, json.loads(body[:size])


def _assert_shed(exc: openai.APIStatusError) -> None:
    assert exc.status_code == 503
    assert exc.code == "server_overloaded" and exc.type == "server_error"
    assert exc.response.headers["retry-after"] == "1" and int(exc.response.headers["retry-after-ms"]) >= 1


def _capacity(gw: RunningGateway) -> dict[str, object]:
    return gw.gateway.capacity.snapshot(CAPS["max_concurrency"], CAPS["max_buffered_body_bytes"])


def _idle(gw: RunningGateway) -> dict[str, object] | None:
    snap = _capacity(gw)
    return snap if snap["in_flight"] == 0 and snap["buffered_body_bytes"] == 0 else None


def test_concurrency_cap_sheds_with_503_and_probes_stay_reachable(gw: RunningGateway) -> None:
    client = openai_client(gw.url + "/v1", api_key="unused")
    shed_before = gw.gateway.capacity.shed["concurrency"]
    with ExitStack() as stack:
        for _ in range(CAPS["max_concurrency"]):
            stack.enter_context(_slow_upload(gw, 100))
        wait_for(lambda: gw.gateway.capacity.in_flight == 3, what="three uploads in flight")
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
        _assert_shed(info.value)
        assert "3 requests in flight" in info.value.message
        # what must answer while the proxy path is full
        assert httpx.get(gw.url + "/health", timeout=10).status_code == 200
        assert httpx.get(gw.url + "/ready", timeout=10).status_code == 200
        metrics = httpx.get(gw.url + "/metrics", timeout=10)
        assert metrics.status_code == 200
        assert "prefix_gateway_in_flight 3.0" in metrics.text
        assert 'prefix_gateway_errors_total{kind="overloaded",route="none"}' in metrics.text
        admin = httpx.get(gw.url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
        assert admin.status_code == 200
        capacity = admin.json()["capacity"]
        assert capacity["in_flight"] == 3 and capacity["max_concurrency"] == 3
        assert capacity["shed"]["concurrency"] == shed_before + 1
    # the clients went away mid-body: their slots and bytes come back
    wait_for(lambda: _idle(gw), what="slots and bytes released after the disconnects")
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert reply.choices[0].message.content is not None


def test_sdk_client_retries_a_shed_after_retry_after_and_gets_served(gw: RunningGateway) -> None:
    """The official SDK retries a 503 after its ``retry-after``: a shed is a delay, not an error."""
    client = openai_client(gw.url + "/v1", api_key="unused", max_retries=3)
    capacity = gw.gateway.capacity
    shed_before = capacity.shed["concurrency"]
    result: dict[str, object] = {}
    with ExitStack() as stack:
        for _ in range(CAPS["max_concurrency"]):
            stack.enter_context(_slow_upload(gw, 100))
        wait_for(lambda: capacity.in_flight == 3, what="three uploads in flight")

        def call() -> None:
            result["reply"] = client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]

        thread = threading.Thread(target=call)
        thread.start()
        wait_for(lambda: capacity.shed["concurrency"] > shed_before, what="the SDK's first attempt shed")
    # the uploads went away: the SDK's retry (after retry-after: 1 s) is served
    thread.join(timeout=30)
    assert not thread.is_alive()
    reply = result["reply"]
    assert reply.choices[0].message.content is not None  # type: ignore[attr-defined]


def test_declared_content_length_is_reserved_before_the_body_is_read(gw: RunningGateway) -> None:
    client = openai_client(gw.url + "/v1", api_key="unused")
    with ExitStack() as stack:
        stack.enter_context(_slow_upload(gw, 16_000))
        stack.enter_context(_slow_upload(gw, 16_000))
        wait_for(lambda: gw.gateway.capacity.buffered_bytes == 32_000, what="two declared bodies reserved")
        # a third declared body does not fit: refused at once, before its body is sent
        third = stack.enter_context(_slow_upload(gw, 16_000, sent=b""))
        status, headers, body = _answer(third)
        assert status == 503 and body["error"]["code"] == "server_overloaded"  # type: ignore[index]
        assert headers[b"retry-after"] == b"1"
        # a small request still fits in what is left; a 10 KB one does not (openai SDK)
        client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
        big = [{"role": "user", "content": "x" * 10_000}]
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model=MODEL, messages=big)  # type: ignore[arg-type]
        _assert_shed(info.value)
        assert gw.gateway.capacity.buffered_bytes == 32_000  # the shed request holds nothing
    wait_for(lambda: _idle(gw), what="reservations released after the disconnects")
    client.chat.completions.create(model=MODEL, messages=big)  # type: ignore[arg-type]


def test_chunked_body_is_reserved_as_it_grows(gw: RunningGateway) -> None:
    with ExitStack() as stack:
        stack.enter_context(_slow_upload(gw, 16_000))
        stack.enter_context(_slow_upload(gw, 16_000))
        wait_for(lambda: gw.gateway.capacity.buffered_bytes == 32_000, what="two declared bodies reserved")
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"%x\r\n%s\r\n" % (4000, b" " * 4000)
        chunked = stack.enter_context(_open(gw, head, chunk * 2))
        wait_for(lambda: gw.gateway.capacity.buffered_bytes == 40_000, what="the chunks so far reserved")
        chunked.sendall(chunk)  # 44,000 bytes would be held: over the cap
        status, _, body = _answer(chunked)
        assert status == 503 and body["error"]["code"] == "server_overloaded"  # type: ignore[index]
        wait_for(lambda: gw.gateway.capacity.buffered_bytes == 32_000, what="the shed upload's bytes released")
    wait_for(lambda: _idle(gw), what="reservations released after the disconnects")


def test_a_body_timeout_releases_slot_and_bytes(sim_url: str) -> None:
    with serve_in_thread(_config(sim_url, body_timeout_s=0.3)) as running:  # type: ignore[arg-type]
        with _slow_upload(running, 16_000) as sock:
            status, _, body = _answer(sock)
            assert status == 408 and body["error"]["code"] == "request_timeout"  # type: ignore[index]
        wait_for(lambda: _idle(running), what="the timed-out upload's slot and bytes released")
        assert running.gateway.capacity.peak_buffered_bytes == 16_000


def test_caps_change_on_reload_and_must_hold_one_body(sim_url: str) -> None:
    old = _config(sim_url)
    new = gateway_config([sim_url], server={"port": 0, "max_concurrency": 7, "max_buffered_body_bytes": 1 << 30})
    effective, notes = live_config(old, new)  # type: ignore[arg-type]
    assert effective.server.max_concurrency == 7 and effective.server.max_buffered_body_bytes == 1 << 30
    assert not any("server" in note for note in notes), notes
    with pytest.raises(ConfigError, match="max_buffered_body_bytes"):
        parse_config(
            {
                "server": {"max_body_bytes": 1 << 20, "max_buffered_body_bytes": 1 << 19},
                "replicas": [{"name": "r0", "url": sim_url}],
                "routes": [{"name": "main"}],
            }
        )
