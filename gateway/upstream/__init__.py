"""Talking to replicas: a small client interface and its aiohttp implementation.

The request path depends only on :class:`~gateway.upstream.client.UpstreamClient`; tests and
benchmarks may inject another implementation through ``ClientFactory``.  aiohttp sits under
it because plain httpx's pool collapses under concurrency (see NOTES §4b).
"""

from gateway.upstream.client import ClientFactory, UpstreamClient, UpstreamResponse

__all__ = ["ClientFactory", "UpstreamClient", "UpstreamResponse"]
