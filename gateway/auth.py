"""API-key checks for ``/admin/*`` and (optionally) ``/v1/*``.

Keys are configured as sha256 hashes (or as plain text in an env var, hashed at startup), so
a leaked config file does not leak a key.  A presented key is hashed and compared against
every configured hash with ``hmac.compare_digest`` (constant time, and no early exit over
the list), so timing does not reveal how much of a key matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


class KeyChecker:
    """Accepts a request if it presents one of the configured keys; disabled when none are."""

    def __init__(self, key_hashes: Iterable[str]) -> None:
        self._hashes = [bytes.fromhex(h) for h in dict.fromkeys(h.lower() for h in key_hashes)]

    @property
    def enabled(self) -> bool:
        return bool(self._hashes)

    def check(self, presented: str | None) -> bool:
        if not presented:
            return False
        digest = hashlib.sha256(presented.encode()).digest()
        ok = False
        for expected in self._hashes:
            ok |= hmac.compare_digest(digest, expected)
        return ok

    def check_authorization(self, header: str | None) -> bool:
        """``Authorization: Bearer <key>``."""
        if not header:
            return False
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return self.check(value.strip())
