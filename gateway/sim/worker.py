"""One replica process, started by :mod:`gateway.sim.launcher` (not a user-facing command).

``python -m gateway.sim.worker --fd N --options JSON [--parent-pid P]``

The parent binds the listening socket and passes it down (``--fd``), so ports are known
before the child starts and no port race exists.  The child exits on SIGINT/SIGTERM and
also when its parent disappears, so a killed test run never leaves replicas behind.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
from typing import Any

from gateway.sim.options import build_options
from gateway.sim.server import serve


def _watch_parent(parent_pid: int, server: Any) -> None:
    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(0.5):
            if os.getppid() != parent_pid:
                server.should_exit = True
                return

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.sim.worker")
    parser.add_argument("--fd", type=int, required=True, help="inherited listening socket")
    parser.add_argument("--options", required=True, help="SimOptions as JSON")
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    options = build_options(json.loads(args.options))
    sock = socket.socket(fileno=args.fd)
    host = sock.getsockname()[0]
    hook = (lambda server: _watch_parent(args.parent_pid, server)) if args.parent_pid else None
    serve(options, host=host, port=sock.getsockname()[1], sock=sock, server_hook=hook)
    return 0


if __name__ == "__main__":
    sys.exit(main())
