"""The listener refuses oversized heads, closes slow partial requests and answers garbage in JSON."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.http.server import RunningGateway, serve_in_thread
from tests.configs import gateway_config

LIMITS = {"port": 0, "header_timeout_s": 0.5, "body_timeout_s": 0.5, "max_header_bytes": 16384, "max_headers": 50}


@pytest.fixture(scope="module")
def gw(upstream: tuple[str, list[dict[str, Any]]]) -> Iterator[RunningGateway]:
    with serve_in_thread(gateway_config([upstream[0]], server=LIMITS)) as running:
        yield running


def _connect(gw: RunningGateway) -> socket.socket:
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _send_all(sock: socket.socket, data: bytes) -> None:
    """Send what the server takes; it may close early (that is the point)."""
    try:
        for i in range(0, len(data), 65536):
            sock.sendall(data[i : i + 65536])
    except OSError:
        pass


def _read_until_close(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def _status_and_error(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    error = json.loads(body)["error"]
    assert {"message", "type", "code"} <= set(error)
    return status, error


def _exchange(gw: RunningGateway, data: bytes) -> tuple[int, dict[str, Any]]:
    with _connect(gw) as sock:
        _send_all(sock, data)
        return _status_and_error(_read_until_close(sock))


def test_huge_authorization_header_is_refused(gw: RunningGateway) -> None:
    data = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b"a" * 10_000_000 + b"\r\n\r\n"
    status, error = _exchange(gw, data)
    assert status == 431 and error["code"] == "headers_too_large"


def test_twenty_thousand_headers_are_refused(gw: RunningGateway) -> None:
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(20_000))
    status, error = _exchange(gw, b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert status == 431 and error["code"] == "headers_too_large"


def test_partial_head_is_closed_with_408(gw: RunningGateway) -> None:
    status, error = _exchange(gw, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    assert status == 408 and error["code"] == "request_timeout"


def test_partial_body_is_closed(gw: RunningGateway) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: 100\r\n\r\n"
    status, error = _exchange(gw, head + b'{"model": "demo')
    assert status == 408 and error["code"] == "request_timeout"


def test_idle_connection_is_closed(gw: RunningGateway) -> None:
    with _connect(gw) as sock:
        assert _read_until_close(sock) == b""


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\x01\x02garbage\r\n\r\n",
        b"FOO / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"GET /\x7f HTTP/1.1\r\n\r\n",
    ],
)
def test_garbage_gets_a_json_400(gw: RunningGateway, data: bytes) -> None:
    status, error = _exchange(gw, data)
    assert status == 400 and error["code"] == "invalid_request"


def test_pipelined_keep_alive_requests_still_work(gw: RunningGateway) -> None:
    one = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    close = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with _connect(gw) as sock:
        _send_all(sock, one + one + close)
        raw = _read_until_close(sock)
    assert raw.count(b"HTTP/1.1 200") == 3


def test_a_normal_post_in_pieces_is_served(gw: RunningGateway) -> None:
    body = json.dumps({"model": "demo-model", "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    with _connect(gw) as sock:
        sock.sendall(head[:20])
        sock.sendall(head[20:])
        sock.sendall(body[:10])
        sock.sendall(body[10:])
        raw = _read_until_close(sock)
    assert raw.startswith(b"HTTP/1.1 200")
