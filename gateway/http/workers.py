"""``prefix-gateway serve --workers N``: N gateway processes on one port, sharing routing state.

One Python process tops out at one core; a pod usually has more.  The parent process here
only supervises:

- every worker is a complete gateway (``gateway.http.server.serve``) bound to the same port with
  ``SO_REUSEPORT``, so the kernel spreads incoming connections across them (no accept lock,
  no hand-off through the parent);
- they share prefix affinity and per-replica load exactly as separate pods do
  (``gateway.state``): through the configured Redis when ``state.backend: redis``, else through
  a small broker the parent runs on a unix socket (``gateway.state.local_broker``);
- SIGTERM/SIGINT are forwarded (each worker drains, see ``gateway.http.drain``) and SIGHUP too (each
  reloads the file); a worker that dies is started again;
- shutdown is bounded: a worker still running well past its own drain and shutdown timeouts is
  killed (and the exit code says so), so a pod never hangs in Terminating on one stuck process.

Per-key limits (``limits:``) count per worker unless a real Redis is configured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from gateway.config import GatewayConfig, parse_config
from gateway.http.server import bind_socket
from gateway.observe.logs import configure_logging
from gateway.service import STOP_TIMEOUT_S
from gateway.state.local_broker import LocalBroker

log = logging.getLogger("prefix_gateway.workers")

BROKER_URL_ENV = "PREFIX_GATEWAY_WORKERS_REDIS_URL"
RESTART_DELAY_S = 1.0
KILL_MARGIN_S = 5.0  # past a worker's own drain + shutdown bounds before it is killed


def worker_config(config: GatewayConfig, port: int, broker_url: str | None, channel: str) -> dict[str, Any]:
    """What each worker runs: the same config on the resolved port, sharing state with its siblings."""
    data = config.model_dump(mode="json", exclude_unset=True)
    data.setdefault("server", {})["port"] = port
    if broker_url is not None:
        state = data.setdefault("state", {})
        state.update(backend="redis", redis_url=broker_url, redis_url_env=BROKER_URL_ENV, channel=channel)
    return data


class Supervisor:
    def __init__(self, config: GatewayConfig, workers: int, config_path: str | None) -> None:
        self.config = config
        self.n = workers
        self.config_path = config_path
        self.children: dict[int, asyncio.subprocess.Process] = {}
        self.stopping = False
        self.killed = 0  # workers that had to be killed on shutdown
        self._stop_signal = signal.SIGTERM
        self._keepers: asyncio.Future[list[None]] | None = None

    async def run(self) -> int:
        host = self.config.server.host
        # hold the port (bound, never listening: the kernel routes no connection here) so that
        # port 0 resolves once for every worker
        anchor = bind_socket(host, self.config.server.port, reuse_port=True)
        port = anchor.getsockname()[1]
        workdir = tempfile.TemporaryDirectory(prefix="prefix-gateway-workers-")
        broker = None
        if self.config.state.backend != "redis":
            broker = LocalBroker(str(Path(workdir.name) / "broker.sock"))
            await broker.start()
        channel = f"prefix-gateway:workers:{os.getpid()}"
        data = worker_config(self.config, port, broker.url if broker else None, channel)
        config_file = Path(workdir.name) / "worker.json"
        config_file.write_text(json.dumps(data))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop, sig)
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        log.info(
            "prefix-gateway: %d workers on http://%s:%d sharing state through %s",
            self.n,
            f"[{shown}]" if ":" in shown else shown,
            port,
            "the local broker" if broker else "Redis",
        )
        self._keepers = asyncio.gather(*(self._keep_running(i, config_file) for i in range(self.n)))
        try:
            await self._keepers
        except asyncio.CancelledError:  # _give_up: an exit that was never reported
            self.killed = max(self.killed, 1)
        finally:
            if broker is not None:
                try:
                    await asyncio.wait_for(broker.stop(), KILL_MARGIN_S)
                except TimeoutError:
                    log.error("the local broker did not close within %.0f s", KILL_MARGIN_S)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            anchor.close()
            workdir.cleanup()
        return 1 if self.killed else 0

    def worker_command(self, config_file: Path) -> list[str]:
        cmd = [sys.executable, "-m", "gateway.http.workers", "--worker", str(config_file)]
        return [*cmd, "--reload-from", self.config_path] if self.config_path else cmd

    async def _keep_running(self, index: int, config_file: Path) -> None:
        cmd = self.worker_command(config_file)
        while not self.stopping:
            env = {**os.environ}
            env.pop(BROKER_URL_ENV, None)
            process = await asyncio.create_subprocess_exec(*cmd, env=env)
            self.children[index] = process
            if self.stopping:  # the stop signal came while this one was being started
                self._signal(process, self._stop_signal)
            code = await process.wait()
            if self.stopping:
                return
            log.error("worker %d exited with %s; starting it again in %.0f s", index, code, RESTART_DELAY_S)
            await asyncio.sleep(RESTART_DELAY_S)

    @staticmethod
    def _signal(process: asyncio.subprocess.Process, sig: int) -> None:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)

    def _forward(self, sig: int) -> None:
        for process in self.children.values():
            self._signal(process, sig)

    def _stop(self, sig: int) -> None:
        """Workers drain on SIGTERM (a second signal, or SIGINT, stops them at once)."""
        if self.stopping and sig == signal.SIGINT:
            self._forward(signal.SIGINT)
            return
        first = not self.stopping
        self.stopping = True
        self._stop_signal = signal.SIGTERM if sig == signal.SIGTERM else signal.SIGINT
        self._forward(self._stop_signal)
        if first:
            server = self.config.server
            bound = server.drain_grace_s + server.timeout_graceful_shutdown_s + STOP_TIMEOUT_S + KILL_MARGIN_S
            asyncio.get_running_loop().call_later(bound, self._kill_stragglers, bound)

    def _kill_stragglers(self, waited_s: float) -> None:
        for index, process in self.children.items():
            if process.returncode is None:
                log.error(
                    "worker %d (pid %d) still running %.0f s after the stop signal; killing it",
                    index,
                    process.pid,
                    waited_s,
                )
                self.killed += 1
                self._signal(process, signal.SIGKILL)
        asyncio.get_running_loop().call_later(KILL_MARGIN_S, self._give_up)

    def _give_up(self) -> None:
        """The last resort: a worker's exit the event loop never reported ends the wait anyway."""
        if self._keepers is not None and not self._keepers.done():
            log.error("worker exits not reported %.0f s after killing them; exiting", KILL_MARGIN_S)
            self._keepers.cancel()


def serve_workers(config: GatewayConfig, workers: int, config_path: str | None = None) -> int:
    """Run ``workers`` gateway processes on ``config.server``'s port until SIGTERM/SIGINT."""
    configure_logging(config.logging)
    try:
        import uvloop

        return uvloop.run(Supervisor(config, workers, config_path).run())
    except ImportError:  # pragma: no cover
        return asyncio.run(Supervisor(config, workers, config_path).run())


def _worker_main(config_file: str, reload_from: str | None) -> int:
    """One worker: the config the supervisor wrote, served on the shared port."""
    from gateway.http.server import serve

    config = parse_config(json.loads(Path(config_file).read_text()), "<workers>")
    # uvicorn re-raises SIGTERM after a graceful shutdown: make that a clean exit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    serve(config, config_path=reload_from, reuse_port=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="internal: one worker of `prefix-gateway serve --workers N`")
    parser.add_argument("--worker", required=True, help="the config the supervisor wrote (JSON)")
    parser.add_argument("--reload-from", help="the operator's config file, reloaded on SIGHUP or change")
    args = parser.parse_args()
    sys.exit(_worker_main(args.worker, args.reload_from))
