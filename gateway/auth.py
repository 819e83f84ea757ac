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

    def match(self, presented: str | None) -> str | None:
        """The sha256 hex of the configured key ``presented`` is, else None.

        Every configured hash is compared (no early exit) so the time does not depend on
        which one matched, nor on how much of any matched."""
        if not presented:
            return None
        digest = hashlib.sha256(presented.encode()).digest()
        found: bytes | None = None
        for expected in self._hashes:
            if hmac.compare_digest(digest, expected):
                found = expected
        return found.hex() if found is not None else None

    def check(self, presented: str | None) -> bool:
        return self.match(presented) is not None

    def identify(self, header: str | None) -> str | None:
        """``Authorization: Bearer <key>``: the matched configured key's sha256 hex, else None.

        The identity per-key limits count against: one key however it is spelled (any case of
        ``Bearer``, any spacing), never the raw header (see ``gateway.limits.identity``)."""
        if not header:
            return None
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.match(value.strip())

    def check_authorization(self, header: str | None) -> bool:
        """``Authorization: Bearer <key>``."""
        return self.identify(header) is not None
