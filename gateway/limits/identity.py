"""Whose bucket a request counts against: the validated API key, else the client's address.

Why not the raw ``Authorization`` header: auth accepts ``Bearer`` in any case and with any
spacing, so hashing the header gave one key as many buckets as it had spellings; and with
auth off every made-up token was a fresh bucket (rotating them escaped the limit and
evicted other clients' buckets from the bounded table).  So:

- auth on (``auth:`` keys configured): the key is the *matched configured key's* hash,
  whatever the spelling (:meth:`gateway.auth.KeyChecker.identify`);
- auth off: the key is the client's address, from ``limits.client_identity``:

  - ``peer``: the TCP peer (behind an ingress that is the ingress: every client shares it);
  - ``forwarded``: the ``limits.forwarded_header`` (``X-Forwarded-For`` by default) *only
    when the peer is one of* ``limits.trusted_proxies`` (CIDRs).  Its hops are read right to
    left, skipping trusted proxies, and the first untrusted hop is the client: the hops left
    of it were written by the client itself and are never believed.  From an untrusted peer
    the header is ignored.

IPv6 addresses are grouped by their ``limits.ipv6_prefix_len`` (/64 by default): one host
is handed a whole /64, so per-address buckets would be as good as unlimited.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import Any

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

_MAX_HOPS = 32  # a longer chain is read only this far from the right (a hostile header is bounded)


def parse_address(text: str) -> Address | None:
    """An address from one hop: ``1.2.3.4``, ``1.2.3.4:5678``, ``::1``, ``[::1]:80``; None if not one."""
    text = text.strip().strip('"')
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:  # IPv4 with a port
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class ClientIdentity:
    """Maps (matched key, headers, peer) to a limit key; built once from ``limits:``."""

    def __init__(
        self,
        source: str = "peer",
        *,
        header: str = "x-forwarded-for",
        trusted_proxies: Iterable[str] = (),
        ipv6_prefix_len: int = 64,
    ) -> None:
        self.source = source
        self.header = header.lower().encode("latin-1")
        self.trusted: list[Network] = [ipaddress.ip_network(c, strict=False) for c in trusted_proxies]
        self.ipv6_prefix_len = ipv6_prefix_len

    def key(self, matched_key: str | None, headers: Sequence[tuple[bytes, bytes]], client: Any) -> str:
        """``k:<hash>`` for a validated key, else ``a:<address>`` (``a:-`` for a unix-socket peer)."""
        if matched_key is not None:
            return "k:" + matched_key[:32]
        return "a:" + self.address(headers, client)

    def address(self, headers: Sequence[tuple[bytes, bytes]], client: Any) -> str:
        peer_text = str(client[0]) if client else ""
        if not peer_text:
            return "-"
        peer = parse_address(peer_text)
        if self.source == "forwarded" and peer is not None and self._trusted(peer):
            forwarded = self._from_header(headers)
            if forwarded is not None:
                return forwarded
        return self._group(peer) if peer is not None else peer_text[:64]

    def _from_header(self, headers: Sequence[tuple[bytes, bytes]]) -> str | None:
        """The right-most untrusted hop of every ``header`` line (in order), else the left-most hop."""
        hops: list[str] = []
        for name, value in headers:
            if name.lower() == self.header:
                hops.extend(h for h in value.decode("latin-1").split(",") if h.strip())
        if not hops:
            return None
        hops = hops[-_MAX_HOPS:]
        for hop in reversed(hops):
            address = parse_address(hop)
            if address is None:  # not an address: the first hop we cannot vouch for
                return hop.strip()[:64]
            if not self._trusted(address):
                return self._group(address)
        first = parse_address(hops[0])
        return self._group(first) if first is not None else hops[0].strip()[:64]

    def _trusted(self, address: Address) -> bool:
        return any(address.version == net.version and address in net for net in self.trusted)

    def _group(self, address: Address) -> str:
        if isinstance(address, ipaddress.IPv6Address) and self.ipv6_prefix_len < 128:
            net = ipaddress.IPv6Network((address, self.ipv6_prefix_len), strict=False)
            return str(net)
        return str(address)
