"""Replicas as the data plane names them: ``ip:port``.

Envoy's override_host (and ORIGINAL_DST) take the pick as ``ip:port``; the picker knows
replicas by their URL.  Replicas should be configured (or discovered) by IP address: a host
name is passed as it is, which override_host matches only if the cluster lists it the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from urllib.parse import urlsplit

from gateway.replicas.pool import Replica

_DEFAULT_PORTS = {"http": 80, "https": 443}


@lru_cache(maxsize=4096)
def endpoint_of(url: str) -> str:
    """``http://10.0.0.7:8000/`` → ``10.0.0.7:8000``; IPv6 as ``[fd00::7]:8000``."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def find(replicas: Iterable[Replica], endpoint: str) -> Replica | None:
    """The replica at ``endpoint`` (linear: a route's pool is small, and this runs only when
    the data plane names another endpoint than the pick)."""
    for replica in replicas:
        if endpoint_of(replica.url) == endpoint:
            return replica
    return None


def outside(replicas: Iterable[Replica], allowed: Iterable[str]) -> list[str]:
    """Names of the replicas whose endpoint is not in ``allowed`` (the subset hint's complement)."""
    keep = set(allowed)
    return [r.name for r in replicas if endpoint_of(r.url) not in keep]
