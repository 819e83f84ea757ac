"""The demo's admin key, handed to the CLI clients on the same machine.

``prefix-gateway demo`` turns the admin API on with a key it generates at start (so
``/admin/stats``, ``explain --gateway`` and ``doctor --gateway`` work on it out of the box),
prints it, and writes it to a file only its user can read, one per port. ``explain`` and
``doctor`` read that file when they are given no key and the gateway's URL names exactly the
loopback host the demo bound: a key never leaves the machine this way, and a gateway elsewhere
always needs one given explicitly.

The file could hand the key to the wrong listener or be planted by another user, so it is
written without following links (a new file renamed into place), read only when it is the
reader's own and private, and only while the demo that wrote it runs (its pid is in the file;
it also removes the file when it stops).
"""

from __future__ import annotations

import ipaddress
import json
import os
import stat
from pathlib import Path
from urllib.parse import urlsplit

#: where the demo writes its keys (``PREFIX_GATEWAY_STATE_DIR`` overrides it)
STATE_DIR_ENV = "PREFIX_GATEWAY_STATE_DIR"


def state_dir() -> Path:
    """``$PREFIX_GATEWAY_STATE_DIR``, else ``~/.cache/prefix-gateway``."""
    explicit = os.environ.get(STATE_DIR_ENV)
    return Path(explicit) if explicit else Path.home() / ".cache" / "prefix-gateway"


def key_file(port: int) -> Path:
    return state_dir() / f"demo-admin-key-{port}"


def _loopback(url: str) -> tuple[str, int] | None:
    """(host, port) of ``url`` when its host is a loopback address, else None."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        host, port = parts.hostname or "", parts.port
        if not ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        return None
    return host, port or (443 if parts.scheme == "https" else 80)


def _private(st: os.stat_result) -> bool:
    """Owned by this user and unreadable by anyone else."""
    return st.st_uid == os.getuid() and not st.st_mode & 0o077


def write_demo_key(host: str, port: int, key: str) -> Path:
    """Write ``key`` for the demo on ``host:port``: a new 0600 file renamed over the old one.

    Raises ``OSError`` when the directory is not safe (another user's, or writable by others):
    the caller then tells the user to pass the key explicitly.
    """
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.stat(directory)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"{directory} is writable by other users: not writing an admin key there")
    path = key_file(port)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump({"host": host, "port": port, "pid": os.getpid(), "key": key}, out)
        os.replace(staging, path)  # replaces a link planted at ``path``, never what it points to
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return path


def remove_demo_key(port: int) -> None:
    key_file(port).unlink(missing_ok=True)


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, as another user: then the file is not ours anyway (checked apart)
    return True


def demo_key_for(url: str) -> str | None:
    """The key of the running demo on exactly ``url``'s loopback host and port, if there is one."""
    where = _loopback(url)
    if where is None:
        return None
    host, port = where
    try:
        fd = os.open(key_file(port), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode) or not _private(st):
            return None
        try:
            record = json.load(handle)
        except ValueError:
            return None
    if not isinstance(record, dict) or record.get("host") != host or record.get("port") != port:
        return None
    if not _alive(record.get("pid")):
        return None  # left behind by a demo that was killed: the port may be someone else's now
    key = record.get("key")
    return key if isinstance(key, str) and key else None
