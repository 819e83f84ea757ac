"""The Rust SGLang router (``sglang-router`` on PyPI, policy ``cache_aware``) as a benchmark row.

Issue 8 judges our TTFT and hit rate against the best peer, on the same simulated fleet in the
same run.  This module only starts and stops that peer; the benchmark sends it the very same
pre-serialized requests it sends our gateways and measures it the same way (the replicas'
reported ``cached_tokens``, client-side TTFT).

The router answers ``/v1/chat/completions`` and ``/v1/completions`` with string prompts only
(token-id prompts get a 422), which is why every workload of the benchmark sends text.

Not named ``sglang_router.py``: a script run as ``python benchmarks/x.py`` puts ``benchmarks/``
on ``sys.path``, and that name would shadow the real package.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from benchmarks.processes import ManagedProcess, free_port

ROW = "sglang"  # the table row's name
POLICY = "cache_aware"


def unavailable_reason() -> str | None:
    """Why the SGLang row cannot run here (``None`` when it can)."""
    try:
        found = importlib.util.find_spec("sglang_router") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "sglang-router is not installed (pip install sglang-router)"


def command(worker_urls: Sequence[str], port: int, prometheus_port: int) -> list[str]:
    """The launch command (sglang-router 0.3.x flags)."""
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        POLICY,
        "--log-level",
        "warn",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prometheus_port),
    ]


class SGLangRouter(ManagedProcess):
    """One running router process; ``url`` takes the same OpenAI requests as our gateway."""


def start(worker_urls: Sequence[str], workdir: Path, name: str = ROW) -> SGLangRouter:
    """Start the router in front of ``worker_urls`` (returns at once; see :func:`wait_ready`)."""
    port, prometheus_port = free_port(), free_port()
    log_path = workdir / f"router-{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            command(worker_urls, port, prometheus_port), stdout=log, stderr=subprocess.STDOUT, cwd=str(workdir)
        )
    return SGLangRouter(name, f"http://127.0.0.1:{port}", proc, log_path)


def wait_ready(router: SGLangRouter, model: str, deadline_s: float = 60.0) -> None:
    """Poll with a tiny completion until the router serves one (it needs a few seconds after start:
    it discovers each worker's metadata before accepting requests)."""
    body = json.dumps({"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0}).encode()
    deadline = time.monotonic() + deadline_s
    last = "no answer"
    while True:
        if router.process.poll() is not None:
            raise RuntimeError(f"sglang router exited with {router.process.returncode}")
        req = urllib.request.Request(
            router.url + "/v1/completions", data=body, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=2.0) as resp:
                if resp.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = f"http {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            raise RuntimeError(f"sglang router not serving at {router.url} within {deadline_s:.0f} s ({last})")
        time.sleep(0.1)
