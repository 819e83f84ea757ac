"""Run the gateway under uvicorn: blocking (``serve``) or in a background thread (tests, demo, bench).

One code path for programs and the CLI: build the ``Gateway`` from a validated config,
wrap it in the ASGI app, and hand it to uvicorn with uvloop + httptools and uvicorn's own
access log off (ours is quieter).  The socket is bound here so that port 0 works and the
real address is known before serving starts.
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
    )
    access.handlers[:], access.propagate = saved
    return DrainingServer(ucfg, getattr(app, "gateway", None), config.server.drain_grace_s)


def serve(
    config: GatewayConfig,
    *,
    client_factory: ClientFactory = aiohttp_factory,
    announce: Callable[[str], None] | None = None,
    config_path: str | os.PathLike[str] | None = None,
    reuse_port: bool = False,
) -> None:
    """Serve until interrupted (what ``prefix-gateway serve`` calls).

    ``announce`` gets the base URL once the socket is bound (the demo prints its banner).
    ``config_path``: the file ``config`` came from, reloaded live on SIGHUP or when it changes.
    ``reuse_port``: one of several worker processes on the port (``gateway.http.workers``).
    """
    configure_logging(config.logging)
    gateway = Gateway(config, client_factory=client_factory)
    gateway.freeze_heap = True  # this process is the gateway: its startup heap lives as long
    if config_path is not None:
        gateway.reloader = Reloader(gateway, config_path)
    sock = bind_socket(config.server.host, config.server.port, reuse_port=reuse_port)
    port = sock.getsockname()[1]
    log.info(
        "prefix-gateway listening on %s (%d replicas, routes: %s)",
        _url(config.server.host, port),
        len(config.replicas),
        ", ".join(f"{r.name}={r.policy}" for r in config.routes),
    )
    server = uvicorn_server(create_app(gateway), config)
    if announce is not None:
        announce(_url(config.server.host, port))
    server.run(sockets=[sock])


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
    gateway = Gateway(config, client_factory=client_factory)
    gateway.freeze_heap = True  # this process is the gateway: its startup heap lives as long
    if config_path is not None:
        gateway.reloader = Reloader(gateway, config_path, reload_poll_s)
    sock = bind_socket(config.server.host, config.server.port)
    port = sock.getsockname()[1]
    server = uvicorn_server(create_app(gateway), config)
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

    thread = threading.Thread(target=run, name="prefix-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if errors or not thread.is_alive():
            raise RuntimeError(f"gateway failed to start: {errors[0] if errors else 'thread exited'}")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError("gateway did not start in time")
        time.sleep(0.01)
    try:
        yield RunningGateway(_url(config.server.host, port), gateway, server)
    finally:
        server.should_exit = True
        thread.join(timeout=startup_timeout)
        sock.close()
