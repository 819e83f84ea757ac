"""The demo's admin key, handed to the CLI clients on the same machine.

``prefix-gateway demo`` turns the admin API on with a key it generates at start (so
``/admin/stats``, ``explain --gateway`` and ``doctor --gateway`` work on it out of the box),
prints it, and writes it to a file only its user can read (mode 0600), one per port.
``explain`` and ``doctor`` read that file when they are given no key and the gateway is on
loopback: a key never leaves the machine this way, and a gateway elsewhere always needs one
given explicitly. The file is removed when the demo stops.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from urllib.parse import urlsplit

#: where the demo writes its keys (``PREFIX_GATEWAY_STATE_DIR`` overrides it)
STATE_DIR_ENV = "PREFIX_GATEWAY_STATE_DIR"


def state_dir() -> Path:
    """``$PREFIX_GATEWAY_STATE_DIR``, else ``~/.cache/prefix-gateway``."""
    explicit = os.environ.get(STATE_DIR_ENV)
    return Path(explicit) if explicit else Path.home() / ".cache" / "prefix-gateway"


def _loopback_port(url: str) -> int | None:
    """The port of ``url`` when its host is this machine's loopback, else None."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    host = parts.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return None
    try:
        return parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None


def key_file(port: int) -> Path:
    return state_dir() / f"demo-admin-key-{port}"


def write_demo_key(port: int, key: str) -> Path:
    """Write ``key`` for the demo listening on ``port`` (0600, created that way: never world-readable)."""
    path = key_file(port)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    os.chmod(path, 0o600)  # an older file may have had other bits
    return path


def remove_demo_key(port: int) -> None:
    key_file(port).unlink(missing_ok=True)


def demo_key_for(url: str) -> str | None:
    """The key a demo on ``url`` wrote, when ``url`` is on loopback and such a file exists."""
    port = _loopback_port(url)
    if port is None:
        return None
    try:
        return key_file(port).read_text().strip() or None
    except OSError:
        return None
