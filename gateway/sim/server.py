"""Running a replica app under uvicorn: in a process (:func:`serve`) or in a thread (tests).

uvicorn runs with uvloop + httptools when installed (they are, via ``uvicorn[standard]``).
The access log is on by default and includes every ``GET /health``, as vLLM's does; turn
it off with ``--disable-uvicorn-access-log`` (vLLM's flag name).
"""

from __future__ import annotations

import contextlib
import copy
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from gateway.sim.app import SimApp, create_app
from gateway.sim.options import SimOptions, build_options

# vLLM's own log format: "INFO 11-29 18:42:11 [loggers.py:123] Engine 000: ..."
VLLM_LOG_FORMAT = "%(levelname)s %(asctime)s [%(module)s.py:%(lineno)d] %(message)s"
VLLM_DATE_FORMAT = "%m-%d %H:%M:%S"


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def logging_config() -> dict[str, Any]:
    """uvicorn's logging (its access-log format is what vLLM prints) plus our vLLM-style loggers."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["vllm"] = {"format": VLLM_LOG_FORMAT, "datefmt": VLLM_DATE_FORMAT}
    config["handlers"]["vllm"] = {
        "formatter": "vllm",
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stdout",
    }
    config["loggers"]["gateway.sim"] = {"handlers": ["vllm"], "level": "INFO", "propagate": False}
    return config


def uvicorn_config(
    app: SimApp, *, host: str = "127.0.0.1", port: int = 0, own_process: bool = True, **extra: Any
) -> uvicorn.Config:
    """uvicorn settings for a replica.

    uvicorn's logging switches are process-global (``access_log=False`` silences the
    ``uvicorn.access`` logger for every server in the process), so only a replica that owns
    its process configures logging; an in-thread replica leaves logging to its host.
    """
    options = app.options
    logging_kwargs: dict[str, Any] = (
        {"log_config": logging_config(), "access_log": not options.disable_uvicorn_access_log}
        if own_process
        else {"log_config": None, "log_level": None, "access_log": True}
    )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop" if _has("uvloop") else "asyncio",
        http="httptools" if _has("httptools") else "h11",
        lifespan="on",
        timeout_keep_alive=30,
        timeout_graceful_shutdown=2,
        backlog=4096,
        **logging_kwargs,
        **extra,
    )


def serve(
    options: SimOptions | Mapping[str, Any] | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    server_hook: Any = None,
) -> None:
    """Run one replica until SIGINT/SIGTERM (blocking).  ``sock``: an already bound socket."""
    app = create_app(build_options(options))
    config = uvicorn_config(app, host=host, port=port)
    server = uvicorn.Server(config)
    if server_hook is not None:
        server_hook(server)
    server.run(sockets=[sock] if sock is not None else None)


@contextlib.contextmanager
def serve_in_thread(
    options: SimOptions | Mapping[str, Any] | None = None,
    *,
    host: str = "127.0.0.1",
    startup_timeout: float = 30.0,
    **overrides: Any,
) -> Iterator[str]:
    """Run one replica in a background thread of this process; yield its base URL.

    Cheap (no process start, no re-import), for unit tests.  Logging is left to the
    host process: records (access log included) propagate to the root logger, and
    ``disable_uvicorn_access_log`` only takes effect in a replica process.
    """
    app = create_app(build_options(options, **overrides))
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    config = uvicorn_config(app, host=host, port=port, own_process=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"sim-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"simulator replica on port {port} failed to start (see the log)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"simulator replica on port {port} did not start within {startup_timeout}s")
        time.sleep(0.01)
    url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
