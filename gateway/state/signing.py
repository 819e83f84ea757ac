"""HMAC envelopes for the messages gateway processes exchange through Redis pub/sub.

Anyone who can publish on the Redis channels — any client of that Redis — could otherwise
forge load reports (steering traffic away from a replica) or affinity records (pulling a
prefix onto one replica).  With a shared secret (``state.secret_env``, default
``PREFIX_GATEWAY_STATE_SECRET``) every message is sent as::

    h1:<unix time, ms>:<hex HMAC-SHA256(secret, "<time>:" + payload)>:<payload>

and a receiver drops (and counts) anything unsigned, badly signed, or older/newer than
``MAX_SKEW_S`` (a recorded message replayed later is refused).  The payload itself is the
unchanged JSON wire format of :mod:`gateway.state.wire`.
"""

from __future__ import annotations

import hashlib
import hmac
import time

PREFIX = b"h1:"
MAX_SKEW_S = 30.0  # pods' clocks (NTP) agree far better; a replay window this short is harmless


class Signer:
    """Seal outgoing payloads and open incoming ones with one shared secret."""

    def __init__(self, secret: str | bytes) -> None:
        self._key = secret.encode() if isinstance(secret, str) else secret

    def _mac(self, stamp: bytes, payload: bytes) -> bytes:
        return hmac.new(self._key, stamp + b":" + payload, hashlib.sha256).hexdigest().encode()

    def seal(self, payload: bytes, now: float | None = None) -> bytes:
        stamp = str(int((time.time() if now is None else now) * 1000)).encode()
        return PREFIX + stamp + b":" + self._mac(stamp, payload) + b":" + payload

    def open(self, message: bytes | str, now: float | None = None) -> bytes | None:
        """The payload of a valid, fresh envelope; None for anything else."""
        data = message.encode("utf-8", "surrogateescape") if isinstance(message, str) else message
        if not data.startswith(PREFIX):
            return None
        parts = data[len(PREFIX) :].split(b":", 2)
        if len(parts) != 3:
            return None
        stamp, mac, payload = parts
        if not stamp.isdigit() or len(stamp) > 16:
            return None
        if not hmac.compare_digest(mac, self._mac(stamp, payload)):
            return None
        age = (time.time() if now is None else now) - int(stamp) / 1000.0
        if abs(age) > MAX_SKEW_S:
            return None
        return payload
