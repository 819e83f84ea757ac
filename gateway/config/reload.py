"""Live reconfiguration: SIGHUP or a changed config file reloads the config in place.

Kubernetes updates a mounted ConfigMap by swapping a symlink (``..data``) to a new directory,
which inotify on the file itself misses; so the file is *polled*: its resolved path, inode,
size and mtime.  A reload is phase one again (the same field-level ``ConfigError``) and, only
if that passes, ``Gateway.apply`` (``gateway.service``): an in-place swap that drops nothing
and says which settings wait for a restart.  This module owns only the lifecycle — watching,
loading, validating, counting and logging.

An invalid file is rejected with its errors; the old config keeps serving.  Every outcome is
logged and counted (``prefix_gateway_config_reloads_total{outcome}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.tasks import cancel_and_wait

if TYPE_CHECKING:  # only to annotate Reconfigurable: the config package does not load routing
    from gateway.routing.routes import RouteTable

log = logging.getLogger("prefix_gateway.reload")


class Reconfigurable(Protocol):
    """What the reloader needs of the gateway (``gateway.service.Gateway``): its running config,
    the outcome counters, the routes (named in the log) and the one method that applies a config."""

    config: GatewayConfig
    reloads: dict[str, int]
    routes: RouteTable

    async def apply(self, new: GatewayConfig) -> list[str]:
        """Swap ``new`` in; returns notes on what waits for a restart."""
        ...


class Reloader:
    """Reload ``path`` on SIGHUP and whenever it changes (polled every ``poll_s``)."""

    def __init__(self, gateway: Reconfigurable, path: str | os.PathLike[str], poll_s: float = 1.0) -> None:
        self.gw = gateway
        self.path = Path(path)
        self.poll_s = poll_s
        self.last_error: str | None = None
        self._lock = asyncio.Lock()
        self._signature = file_signature(self.path)
        self._task: asyncio.Task[None] | None = None
        self._sighup = False

    async def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="config-watch")
        if threading.current_thread() is threading.main_thread():
            loop = asyncio.get_running_loop()
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload("SIGHUP")))
                self._sighup = True

    async def stop(self) -> None:
        if self._sighup:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await cancel_and_wait(self._task)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            signature = file_signature(self.path)
            if signature != self._signature and signature is not None:
                self._signature = signature
                await self.reload("file changed")

    async def reload(self, reason: str) -> bool:
        """Load, validate and apply the file; False (old config kept) when it is invalid."""
        async with self._lock:
            self._signature = file_signature(self.path) or self._signature
            try:
                new = load_config(self.path)
            except ConfigError as exc:
                self.last_error = str(exc)
                self.gw.reloads["rejected"] += 1
                log.error("config reload (%s) rejected, the running config stays:\n%s", reason, exc)
                return False
            if new == self.gw.config:
                self.gw.reloads["unchanged"] += 1
                log.info("config reload (%s): %s unchanged", reason, self.path)
                return True
            try:
                notes = await self.gw.apply(new)
            except Exception as exc:  # a bug here must not take the gateway down
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.gw.reloads["rejected"] += 1
                log.exception("config reload (%s) failed while applying; the running config stays", reason)
                return False
            self.last_error = None
            self.gw.reloads["ok"] += 1
            log.info(
                "config reload (%s) applied from %s: routes %s%s",
                reason,
                self.path,
                ", ".join(f"{r.name}={r.policy}" for r in self.gw.routes.routes),
                "".join(f"; {note}" for note in notes),
            )
            return True


def file_signature(path: Path) -> tuple[Any, ...] | None:
    """What changes when the file (or the symlink chain leading to it) is replaced."""
    try:
        st = os.stat(path)
        return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        return None
