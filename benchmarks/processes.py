"""Child processes a benchmark starts and must stop: our gateway, a peer router.

One small place for what every such process needs (a free loopback port, a polite stop), so
the benchmark and its peers' launchers do not each carry a copy.
"""

from __future__ import annotations

import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A port nothing listens on right now (on 127.0.0.1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ManagedProcess:
    """A started server: where it answers, its process and its log file."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s: a benchmark never leaves a server behind."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
