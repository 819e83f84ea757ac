"""The picker's servers: gRPC (ext_proc + health) on ``--port``, HTTP (metrics/admin) on ``--metrics-port``.

Both run in one event loop over one :class:`~gateway.service.Gateway`, built from the same
config as ``serve``.  The HTTP side is the FastAPI app ``serve`` has (``/metrics``,
``/admin/*``, ``/health``, ``/ready``, ``/v1/models``) without the proxied ``/v1`` paths —
inference goes through Envoy only — and its lifespan starts and stops the gateway, as in
``serve``.  SIGTERM drains as ``serve`` does (``server.drain_grace_s`` not ready: the gRPC
health services turn NOT_SERVING, so Envoy's health check moves away), then the gRPC server
stops, giving running streams ``server.timeout_graceful_shutdown_s``.

gRPC health services (the protocol's): ``liveness`` (the process answers), ``readiness`` and
``envoy.service.ext_proc.v3.ExternalProcessor`` (every route has a healthy replica and the
gateway is not draining: ``Gateway.readiness``), and ``""`` (the same as readiness).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from gateway.config import GatewayConfig
from gateway.config.reload import Reloader
from gateway.epp.stream import PickerStream
from gateway.http.app import build_fastapi
from gateway.http.server import bind_socket, uvicorn_server
from gateway.service import Gateway
from gateway.upstream.aiohttp_client import aiohttp_factory
from gateway.upstream.client import ClientFactory

log = logging.getLogger("prefix_gateway.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
HEALTH_INTERVAL_S = 0.5  # how often readiness is re-read for the gRPC health services


class Picker(ep_grpc.ExternalProcessorServicer):
    """``ExternalProcessor/Process``: one :class:`PickerStream` per stream."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        stream = PickerStream(self.gateway)
        try:
            async for message in request_iterator:
                try:
                    out = await stream.handle(message)
                except Exception:
                    # a bug or a protocol violation after the answer started: never the picker's end
                    log.exception("request %s: the picker failed on an ext_proc message", stream.request_id)
                    out = stream.internal_error()
                    if not out:
                        await context.abort(grpc.StatusCode.INTERNAL, "picker error while relaying the response")
                for response in out:
                    yield response
                if stream.finished and stream.phase == "done" and stream.plan is None and stream.endpoint is not None:
                    return  # an immediate response was sent: Envoy ends the request
        finally:
            stream.close()


async def _health_loop(gateway: Gateway, health: health_aio.HealthServicer) -> None:
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    await health.set("liveness", serving)
    last = None
    while True:
        ready, _ = gateway.readiness()
        if ready != last:
            for service in READY_SERVICES:
                await health.set(service, serving if ready else not_serving)
            last = ready
        await asyncio.sleep(HEALTH_INTERVAL_S)


@dataclass(frozen=True)
class Listen:
    """Where the picker listens: gRPC ``host:port`` (TLS when cert and key are given), and the HTTP port."""

    host: str = "0.0.0.0"
    port: int = 9002
    metrics_port: int = 9090
    tls_cert: str | None = None
    tls_key: str | None = None


class PickerServer:
    """One gateway as a picker; :meth:`run` here until interrupted, or :meth:`start_in_thread`."""

    def __init__(
        self,
        config: GatewayConfig,
        listen: Listen,
        *,
        client_factory: ClientFactory = aiohttp_factory,
        config_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.config = config
        self.listen = listen
        self.gateway = Gateway(config, client_factory=client_factory)
        if config_path is not None:
            self.gateway.reloader = Reloader(self.gateway, config_path, 1.0)
        self.sock = bind_socket(listen.host, listen.metrics_port)
        self.metrics_port = self.sock.getsockname()[1]
        self.http = uvicorn_server(build_fastapi(self.gateway), config)
        self.grpc_port = 0  # known once serving (port 0: any free one)
        self.serving = False
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []

    def _credentials(self) -> grpc.ServerCredentials | None:
        cert, key = self.listen.tls_cert, self.listen.tls_key
        if not cert and not key:
            return None
        if not (cert and key):
            raise SystemExit("prefix-gateway epp: --tls-cert and --tls-key go together")
        with open(key, "rb") as k, open(cert, "rb") as c:
            return grpc.ssl_server_credentials([(k.read(), c.read())])

    async def serve(self, announce: Callable[[PickerServer], None] | None = None) -> None:
        http = asyncio.get_running_loop().create_task(self.http.serve(sockets=[self.sock]), name="epp-http")
        while not self.http.started:  # the lifespan started the gateway (replicas probed, tokenizers warm)
            if http.done():
                await http  # its error, if it failed to start
                return
            await asyncio.sleep(0.01)
        limit = self.config.server.max_body_bytes + (1 << 20)
        server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        )
        ep_grpc.add_ExternalProcessorServicer_to_server(Picker(self.gateway), server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        address = (
            f"[{self.listen.host}]:{self.listen.port}"
            if ":" in self.listen.host
            else f"{self.listen.host}:{self.listen.port}"
        )
        credentials = self._credentials()
        if credentials is None:
            self.grpc_port = server.add_insecure_port(address)
        else:
            self.grpc_port = server.add_secure_port(address, credentials)
        await server.start()
        checker = asyncio.get_running_loop().create_task(_health_loop(self.gateway, health), name="epp-health")
        self.serving = True
        log.info(
            "prefix-gateway epp: ext_proc on %s:%d (%s), metrics and admin on http port %d",
            self.listen.host,
            self.grpc_port,
            "TLS" if credentials else "plaintext",
            self.metrics_port,
        )
        if announce is not None:
            announce(self)
        try:
            await http  # until SIGTERM/SIGINT (uvicorn's handlers), after the drain grace
        finally:
            self.serving = False
            checker.cancel()
            await server.stop(self.config.server.timeout_graceful_shutdown_s)

    def run(self, announce: Callable[[PickerServer], None] | None = None) -> None:
        # asyncio's own loop, not uvloop: grpc.aio is built and tested on the default loop (no
        # measurable difference here: the cost is grpc's per-message work, see docs/endpoint-picker.md)
        asyncio.run(self.serve(announce))

    def start_in_thread(self, startup_timeout: float = 30.0) -> PickerServer:
        """Serve from a background thread (tests, the demo); returns once both ports serve."""

        def run() -> None:
            try:
                asyncio.run(self.serve())
            except BaseException as exc:  # pragma: no cover - surfaced below
                self._errors.append(exc)

        thread = self._thread = threading.Thread(target=run, name="prefix-gateway-epp", daemon=True)
        thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self.serving:
            if self._errors or not thread.is_alive():
                raise RuntimeError(f"picker failed to start: {self._errors[0] if self._errors else 'thread exited'}")
            if time.monotonic() > deadline:
                self.http.should_exit = True
                raise TimeoutError("picker did not start in time")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.http.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        self.sock.close()
