"""Child processes a benchmark starts and must stop: our gateway, a peer router.

One small place for what every such process needs (a free loopback port, a polite stop), so
the benchmark and its peers' launchers do not each carry a copy.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port nothing listens on right now (on 127.0.0.1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 10) -> None:
    """``sig``, then SIGKILL after ``timeout`` s: a benchmark never leaves a server behind."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class ManagedProcess:
    """A started server: where it answers, its process and its log file."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        stop_process(self.process)


def stop_all(procs: Sequence[ManagedProcess]) -> None:
    """Stop several servers at once: SIGINT to all first (a gateway then skips its drain grace,
    ``server.drain_grace_s``: the run is over), then wait for each as ``stop`` does."""
    for proc in procs:
        if proc.process.poll() is None:
            proc.process.send_signal(signal.SIGINT)
    for proc in procs:
        try:
            proc.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.stop()


@contextmanager
def serve_gateway(config: dict[str, Any], log_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``prefix-gateway serve`` with ``config`` (port 0); yields (base URL, process) once it answers.

    The "listening on" line comes when the socket is bound, before uvicorn serves on it, so the
    URL is read from the log and then ``/health`` is polled (deadline 30 s).
    """
    config_path = log_path.with_suffix(".yaml")
    config_path.write_text(yaml.safe_dump(config))
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
        )
        try:
            deadline = time.monotonic() + 30
            url = None
            while url is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gateway did not start; see {log_path}")
                match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log_path.read_text())
                url = match.group(1) if match else None
                time.sleep(0.05)
            while not _answers(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gateway did not answer; see {log_path}")
                time.sleep(0.05)
            yield url, proc
        finally:
            stop_process(proc, signal.SIGINT, 15)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
