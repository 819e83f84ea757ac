"""Graceful drain on SIGTERM: stop being *ready* first, stop *accepting* a little later.

Kubernetes sends SIGTERM while, concurrently, it removes the pod from the Service's
endpoints; load balancers and kube-proxy learn of that a moment later.  Closing the
listening socket at once (uvicorn's default) refuses the connections still routed here in
that moment.  So the gateway drains in two steps:

1. at SIGTERM ``/ready`` answers 503 at once, and new connections are still accepted for
   ``server.drain_grace_s``;
2. then uvicorn's own shutdown: the socket closes, idle keep-alive connections close, and
   running requests and streams finish — up to ``server.timeout_graceful_shutdown_s`` — before
   the process exits (at once when the last one is done).

A second signal, or SIGINT (Ctrl-C), skips the grace.  ``k8s/deployment.yaml`` sizes
``terminationGracePeriodSeconds`` to cover preStop + grace + deadline.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger("prefix_gateway")


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` with a not-ready grace period before its graceful shutdown."""

    def __init__(self, config: uvicorn.Config, gateway: Any = None, grace_s: float = 0.0) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.grace_s = grace_s
        self.drain_until: float | None = None

    def begin_drain(self) -> None:
        """Turn not-ready now; stop accepting after the grace (also callable without a signal)."""
        if self.drain_until is not None:
            return
        if self.gateway is not None:
            self.gateway.draining = True
        self.drain_until = time.monotonic() + self.grace_s
        log.info(
            "draining: /ready is 503; new connections accepted for %.1f s more, then running requests get up to %.0f s",
            self.grace_s,
            self.config.timeout_graceful_shutdown or 0,
        )

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain_until is None and self.grace_s > 0:
            self._captured_signals.append(sig)  # re-raised after serving, like uvicorn's own
            self.begin_drain()
            return
        if self.gateway is not None:
            self.gateway.draining = True
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_until is not None and time.monotonic() >= self.drain_until:
            self.should_exit = True
        return await super().on_tick(counter)
