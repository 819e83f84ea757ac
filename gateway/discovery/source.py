"""What every discovery source reports, and how discovered replicas are named.

Names must be stable for as long as the replica lives (the ring hashes them, the affinity
index and metrics are keyed by them) and valid replica names: letters, digits, ``-_.``,
at most 64 characters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

MAX_NAME = 64


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A replica as a source sees it: a stable name and its base URL."""

    name: str
    url: str


Publish = Callable[[Sequence[Endpoint]], Awaitable[None]]


def replica_name(source: str, ident: str) -> str:
    """``source-ident`` with characters a replica name cannot hold replaced; long ones hashed."""
    clean = "".join(c if c.isalnum() or c in "-_." else "-" for c in ident)
    name = f"{source}-{clean}"
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(ident.encode()).hexdigest()[:10]
        name = f"{name[: MAX_NAME - 11]}-{digest}"
    return name


def base_url(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"
