"""The ``/v1/*`` proxy: body parsing, forwarding with retries, stream relay, usage sniffing."""

from gateway.proxy.handler import ProxyEndpoint

__all__ = ["ProxyEndpoint"]
