"""Run the gateway under uvicorn: blocking (``serve``) or in a background thread (tests, demo, bench).

One code path for programs and the CLI, :class:`GatewayServer`: build the ``Gateway`` from a
validated config, wrap it in the ASGI app, and hand it to uvicorn with uvloop + httptools and
uvicorn's own access log off (ours is quieter).  The socket is bound here so that port 0 works
and the real address is known before serving starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from gateway.config import GatewayConfig
from gateway.config.reload import Reloader
from gateway.http.app import create_app
from gateway.http.drain import DrainingServer
from gateway.http.protocol import HttpLimits, protocol_class
from gateway.observe.logs import configure_logging
from gateway.service import Gateway
from gateway.upstream.aiohttp_client import aiohttp_factory
from gateway.upstream.client import ClientFactory

log = logging.getLogger("prefix_gateway")


def bind_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """``reuse_port``: several worker processes bind the same port; the kernel spreads connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def uvicorn_server(app: Any, config: GatewayConfig) -> uvicorn.Server:
    # uvicorn.Config(access_log=False) silences the process-wide "uvicorn.access" logger;
    # a gateway embedded in a host process (tests, the demo's neighbours) must not do that.
    access = logging.getLogger("uvicorn.access")
    saved = (list(access.handlers), access.propagate)
    limits = HttpLimits(
        header_timeout_s=config.server.header_timeout_s,
        body_timeout_s=config.server.body_timeout_s,
        max_header_bytes=config.server.max_header_bytes,
        max_headers=config.server.max_headers,
    )
    ucfg = uvicorn.Config(
        app,
        loop="uvloop",
        http=protocol_class(limits),  # httptools plus header/body timeouts and header limits
        ws="none",  # no WebSocket endpoints: an Upgrade request is answered as plain HTTP (JSON)
        lifespan="on",
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=config.server.timeout_graceful_shutdown_s,
        timeout_keep_alive=75,  # longer than typical client pools' idle timeouts
        server_header=False,
        date_header=False,
        # the peer stays the peer: uvicorn would rewrite it from X-Forwarded-For for any loopback
        # peer; whom to believe is limits.trusted_proxies' job (gateway.limits.identity)
        proxy_headers=False,
    )
    access.handlers[:], access.propagate = saved
    return DrainingServer(ucfg, getattr(app, "gateway", None), config.server.drain_grace_s)


class GatewayServer:
    """One gateway, its socket and its uvicorn server: what serving blocking and in a thread share.

    Built in one go — the ``Gateway`` from a validated config (with a ``Reloader`` when
    ``config_path`` names the file it came from), the socket bound (so port 0 works and
    :attr:`url` is known before serving starts), the ASGI app wrapped for uvicorn — then
    either :meth:`run` here until interrupted, or :meth:`start_in_thread` and later :meth:`stop`.
    ``reuse_port``: one of several worker processes on the port (``gateway.http.workers``).
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        client_factory: ClientFactory = aiohttp_factory,
        config_path: str | os.PathLike[str] | None = None,
        reload_poll_s: float = 1.0,
        reuse_port: bool = False,
    ) -> None:
        self.config = config
        self.gateway = Gateway(config, client_factory=client_factory)
        self.gateway.freeze_heap = True  # this process is the gateway: its startup heap lives as long
        if config_path is not None:
            self.gateway.reloader = Reloader(self.gateway, config_path, reload_poll_s)
        self.sock = bind_socket(config.server.host, config.server.port, reuse_port=reuse_port)
        self.url = _url(config.server.host, self.sock.getsockname()[1])  # base URL without /v1
        self.server = uvicorn_server(create_app(self.gateway), config)
        self._thread: threading.Thread | None = None

    def run(self, announce: Callable[[str], None] | None = None) -> None:
        """Serve in this thread until interrupted; ``announce`` gets :attr:`url` first."""
        config = self.config
        log.info(
            "prefix-gateway listening on %s (%d replicas, routes: %s)",
            self.url,
            len(config.replicas),
            ", ".join(f"{r.name}={r.policy}" for r in config.routes),
        )
        if announce is not None:
            announce(self.url)
        self.server.run(sockets=[self.sock])

    def start_in_thread(self, startup_timeout: float = 30.0) -> RunningGateway:
        """Serve from a background thread (its own event loop); returns once it serves."""
        server, sock = self.server, self.sock
        errors: list[BaseException] = []

        def run() -> None:
            try:
                import uvloop

                loop = uvloop.new_event_loop()
            except ImportError:  # pragma: no cover
                loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(server.serve(sockets=[sock]))
            except BaseException as exc:  # pragma: no cover - surfaced below
                errors.append(exc)
            finally:
                loop.close()

        thread = self._thread = threading.Thread(target=run, name="prefix-gateway", daemon=True)
        thread.start()
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if errors or not thread.is_alive():
                raise RuntimeError(f"gateway failed to start: {errors[0] if errors else 'thread exited'}")
            if time.monotonic() > deadline:
                server.should_exit = True
                raise TimeoutError("gateway did not start in time")
            time.sleep(0.01)
        return RunningGateway(self.url, self.gateway, server)

    def stop(self, timeout: float = 30.0) -> None:
        """End a :meth:`start_in_thread` serve: graceful shutdown, thread joined (bounded), socket closed."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        self.sock.close()


def serve(
    config: GatewayConfig,
    *,
    client_factory: ClientFactory = aiohttp_factory,
    announce: Callable[[str], None] | None = None,
    config_path: str | os.PathLike[str] | None = None,
    reuse_port: bool = False,
) -> None:
    """Serve until interrupted (what ``prefix-gateway serve`` and each worker call).

    ``announce`` gets the base URL once the socket is bound (the demo prints its banner).
    ``config_path``: the file ``config`` came from, reloaded live on SIGHUP or when it changes.
    ``reuse_port``: one of several worker processes on the port (``gateway.http.workers``).
    """
    configure_logging(config.logging)
    GatewayServer(config, client_factory=client_factory, config_path=config_path, reuse_port=reuse_port).run(announce)


@dataclass
class RunningGateway:
    url: str  # base URL without /v1
    gateway: Gateway
    server: uvicorn.Server

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"


@contextlib.contextmanager
def serve_in_thread(
    config: GatewayConfig,
    *,
    client_factory: ClientFactory = aiohttp_factory,
    startup_timeout: float = 30.0,
    configure_logs: bool = False,
    config_path: str | os.PathLike[str] | None = None,
    reload_poll_s: float = 1.0,
) -> Iterator[RunningGateway]:
    """Run a gateway in a background thread (own event loop); yields once it serves."""
    if configure_logs:
        configure_logging(config.logging)
    server = GatewayServer(config, client_factory=client_factory, config_path=config_path, reload_poll_s=reload_poll_s)
    running = server.start_in_thread(startup_timeout)
    try:
        yield running
    finally:
        server.stop(timeout=startup_timeout)
