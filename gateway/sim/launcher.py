"""Start N replica processes and know when they are ready: for tests, benchmarks and the CLI.

Each replica is its own OS process (a benchmark of the gateway must never be limited by
one simulator process).  The parent binds every listening socket itself (port 0 = a free
port) and hands it to the child, so there is no port race, then polls ``GET /health``
with a deadline.  Children are stopped (SIGTERM, then SIGKILL) on exit, on exceptions,
and they stop by themselves if the parent dies.

    with run_replicas(2, time_scale=0, per_replica=[{}, {"num_gpu_blocks": 64}]) as urls:
        ...  # urls == ["http://127.0.0.1:PORT0", "http://127.0.0.1:PORT1"]

``kv_events=True`` turns vLLM's KV cache events on for every replica, each on two free
ports of its own (publisher and replay), kept across :meth:`ReplicaGroup.restart` like a
pod's fixed port; ``ReplicaProcess.kv_events_endpoint`` / ``kv_replay_endpoint`` say where
to connect.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from gateway.sim.options import SimOptions, build_options

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class ReplicaStartError(RuntimeError):
    """A replica process exited or did not answer ``GET /health`` in time."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket the child can inherit.  Raises OSError when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (for ZMQ endpoints, which the child binds itself)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def kv_events_options(topic: str = "kv-events", host: str = "127.0.0.1") -> dict[str, Any]:
    """``kv_events_config`` for one replica: vLLM's keys, bound on two free ports."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{free_port(host)}",
        "replay_endpoint": f"tcp://*:{free_port(host)}",
        "topic": topic,
    }


def _connectable(endpoint: str | None, host: str) -> str | None:
    """``tcp://*:P`` as a consumer on ``host`` connects to it."""
    if endpoint is None:
        return None
    return endpoint.replace("*", f"[{host}]" if ":" in host else host, 1)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The package may not be installed (tests run from the checkout): make it importable.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class ReplicaProcess:
    """One running replica: its options, URL and process."""

    def __init__(self, index: int, options: SimOptions, host: str, port: int) -> None:
        self.index = index
        self.options = options
        self.host = host
        self.port = port
        self.url = _url(host, port)
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where to connect a SUB for this replica's KV events (None: events off)."""
        config = self.options.kv_events_config
        return _connectable(config.endpoint, self.host) if config is not None and config.publishes else None

    @property
    def kv_replay_endpoint(self) -> str | None:
        config = self.options.kv_events_config
        return _connectable(config.replay_endpoint, self.host) if config is not None and config.publishes else None

    def spawn(self, sock: socket.socket, log_path: Path | None) -> None:
        cmd = [
            sys.executable,
            "-m",
            "gateway.sim.worker",
            "--fd",
            str(sock.fileno()),
            "--options",
            json.dumps(self.options.model_dump(mode="json")),
            "--parent-pid",
            str(os.getpid()),
        ]
        out: IO[bytes] | None = None
        if log_path is not None:
            self._log = out = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            cmd, pass_fds=(sock.fileno(),), env=_child_env(), stdout=out, stderr=subprocess.STDOUT if out else None
        )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout: float = 1.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class ReplicaGroup:
    """N replica processes.  Use as a context manager, or call :meth:`stop` yourself."""

    def __init__(
        self,
        n: int,
        *,
        host: str = "127.0.0.1",
        ports: Sequence[int] | None = None,
        per_replica: Sequence[Mapping[str, Any]] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        kv_events: bool = False,
        **options: Any,
    ) -> None:
        if n < 1:
            raise ValueError("need at least one replica")
        if per_replica is not None and len(per_replica) > n:
            raise ValueError(f"per_replica has {len(per_replica)} entries for {n} replicas")
        if ports is not None and len(ports) != n:
            raise ValueError("ports must give one port per replica")
        self.host = host
        self.log_dir = Path(log_dir) if log_dir is not None else None
        overrides = list(per_replica or [])
        if kv_events:  # each replica its own ports, unless given explicitly
            overrides += [{}] * (n - len(overrides))
            overrides = [
                o
                if "kv_events_config" in o or "kv_events_config" in options
                else {**o, "kv_events_config": kv_events_options(host=host)}
                for o in overrides
            ]
        # Validate everything before starting anything: a bad option is one clear error.
        self.options = [build_options({**options, **(overrides[i] if i < len(overrides) else {})}) for i in range(n)]
        self._ports = list(ports) if ports is not None else [0] * n
        self.replicas: list[ReplicaProcess] = []

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def start(self, startup_timeout: float = 60.0) -> ReplicaGroup:
        """Bind, spawn and wait until every replica answers ``GET /health``."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        sockets: list[socket.socket] = []
        try:
            for port in self._ports:
                try:
                    sockets.append(bind_listener(self.host, port))
                except OSError as exc:
                    raise ReplicaStartError(f"cannot listen on {_url(self.host, port)}: {exc.strerror}") from exc
            for index, (opts, sock) in enumerate(zip(self.options, sockets, strict=True)):
                replica = ReplicaProcess(index, opts, self.host, sock.getsockname()[1])
                self.replicas.append(replica)
                replica.spawn(sock, self._log_path(index))
        except BaseException:
            self.stop()
            raise
        finally:
            for sock in sockets:  # the children hold their own copies
                sock.close()
        try:
            self.wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _log_path(self, index: int) -> Path | None:
        return self.log_dir / f"replica-{index}.log" if self.log_dir is not None else None

    def wait_healthy(self, timeout: float, replicas: Sequence[ReplicaProcess] | None = None) -> None:
        deadline = time.monotonic() + timeout
        pending = list(replicas if replicas is not None else self.replicas)
        while pending:
            for replica in list(pending):
                if not replica.alive:
                    code = replica.process.returncode if replica.process else None
                    where = f" (log: {self._log_path(replica.index)})" if self.log_dir else ""
                    raise ReplicaStartError(
                        f"replica {replica.index} ({replica.url}) exited with code {code} during startup{where}"
                    )
                if replica.healthy(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                    pending.remove(replica)
            if pending:
                if time.monotonic() > deadline:
                    names = ", ".join(f"{r.index} ({r.url})" for r in pending)
                    raise ReplicaStartError(f"replica(s) {names} did not answer GET /health within {timeout}s")
                time.sleep(0.05)

    def kill(self, index: int) -> None:
        """SIGKILL one replica (a crash, for reliability tests); its port then refuses connections."""
        replica = self.replicas[index]
        replica.signal(signal.SIGKILL)
        if replica.process is not None:
            replica.process.wait()
        replica.close_log()

    def restart(self, index: int, startup_timeout: float = 60.0) -> str:
        """Start replica ``index`` again on its port (after :meth:`kill`): an empty prefix cache."""
        replica = self.replicas[index]
        if replica.alive:
            self.kill(index)
        sock = bind_listener(self.host, replica.port)
        try:
            replica.spawn(sock, self._log_path(index))
        finally:
            sock.close()
        self.wait_healthy(startup_timeout, [replica])
        return replica.url

    def dead(self) -> list[int]:
        return [r.index for r in self.replicas if not r.alive]

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM everyone, wait up to ``timeout``, SIGKILL the rest.  Idempotent."""
        for replica in self.replicas:
            replica.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for replica in self.replicas:
            proc = replica.process
            if proc is None:
                continue
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            replica.close_log()

    def __enter__(self) -> ReplicaGroup:
        if not self.replicas:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def run_replicas(
    n: int,
    *,
    host: str = "127.0.0.1",
    per_replica: list[dict[str, Any]] | None = None,
    startup_timeout: float = 60.0,
    log_dir: str | os.PathLike[str] | None = None,
    kv_events: bool = False,
    **options: Any,
) -> Iterator[list[str]]:
    """Run ``n`` replica processes on free ports; yield their base URLs (no ``/v1``).

    ``options`` are the CLI flags with underscores (``time_scale=0``, ``num_gpu_blocks=64``,
    ...); ``per_replica[i]`` overrides them for replica ``i``.  ``log_dir`` sends each
    replica's output to ``replica-I.log`` there instead of this process's stdout/stderr.
    ``kv_events`` turns vLLM's KV events on, on free ports (see the module docstring).
    """
    group = ReplicaGroup(n, host=host, per_replica=per_replica, log_dir=log_dir, kv_events=kv_events, **options)
    group.start(startup_timeout)
    try:
        yield group.urls
    finally:
        group.stop()
