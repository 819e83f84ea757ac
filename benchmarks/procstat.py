"""Per-process CPU accounting for benchmarks: CPU-seconds are steadier than wall time on a shared machine."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process from /proc (Linux); 0 where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def rss_bytes(pid: int) -> int:
    """Resident set size of a process from /proc (Linux); 0 where unavailable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


class RssSampler:
    """A process's RSS every ``interval_s`` from a daemon thread, to report its peak over a run."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        import threading

        self.pid = pid
        self.interval_s = interval_s
        self.start_bytes = rss_bytes(pid)
        self.peak_bytes = self.start_bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, rss_bytes(self.pid))

    def mark(self) -> int:
        """RSS now (also counted towards the peak)."""
        now = rss_bytes(self.pid)
        self.peak_bytes = max(self.peak_bytes, now)
        return now

    def stop(self) -> int:
        """Stop sampling; the RSS at the end."""
        self._stop.set()
        self._thread.join(timeout=5)
        return self.mark()
