"""DNS discovery: a headless Service's A/AAAA records, resolved again every ``interval_s``.

The plainest Kubernetes way to find pods: a headless Service answers with one record per
*ready* pod.  A failed lookup keeps the last answer (a DNS blip must not empty the pool;
replicas that are really gone fail their health checks), and is counted and logged once per
streak.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from gateway.discovery.settings import DnsSettings
from gateway.discovery.source import Endpoint, Publish, base_url, replica_name
from gateway.discovery.stats import SourceStats

log = logging.getLogger("prefix_gateway.discovery")

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    """Addresses of ``host`` from the system resolver (A and AAAA), deduplicated, sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class DnsSource:
    """Reports ``name-<address>`` replicas for every address ``settings.host`` resolves to."""

    def __init__(self, name: str, settings: DnsSettings, stats: SourceStats, resolver: Resolver | None = None) -> None:
        self.name = name
        self.settings = settings
        self.stats = stats
        self.resolver = resolver or system_resolver

    def endpoints(self, addresses: list[str]) -> list[Endpoint]:
        s = self.settings
        return [Endpoint(replica_name(self.name, a), base_url(s.scheme, a, s.port)) for a in sorted(set(addresses))]

    async def poll(self, publish: Publish) -> None:
        """One lookup; publishes its answer, or keeps the last one on failure."""
        try:
            addresses = await self.resolver(self.settings.host, self.settings.port)
        except (OSError, ValueError) as exc:  # socket.gaierror is an OSError
            self.stats.errors += 1
            if self.stats.failing is None:
                log.warning(
                    "discovery %s: cannot resolve %s (%s); keeping the last answer", self.name, self.settings.host, exc
                )
            self.stats.failing = str(exc) or type(exc).__name__
            return
        if self.stats.failing is not None:
            log.info("discovery %s: %s resolves again", self.name, self.settings.host)
        self.stats.failing = None
        self.stats.updates += 1
        await publish(self.endpoints(addresses))

    async def run(self, publish: Publish) -> None:
        while True:
            await self.poll(publish)
            await asyncio.sleep(self.settings.interval_s)
