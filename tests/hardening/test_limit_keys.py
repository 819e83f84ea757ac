"""Whose bucket a request counts against: the matched API key, else the client's address."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.auth import KeyChecker
from gateway.config import ConfigError, sha256_hex
from gateway.http.server import RunningGateway, serve_in_thread
from gateway.limits.identity import ClientIdentity
from gateway.limits.local import LocalBuckets
from tests.configs import gateway_config
from tests.hardening.hostile_upstream import MODEL

#: six spellings auth accepts for one key (scheme case, spacing)
SPELLINGS = ["Bearer k1", "bearer k1", "BEARER k1", "Bearer   k1", "bEaReR k1", "Bearer \t k1"]


def _post(gw: RunningGateway, authorization: str | None = None, **headers: str) -> httpx.Response:
    if authorization is not None:
        headers["Authorization"] = authorization
    return httpx.post(
        f"{gw.openai_base_url}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        headers=headers,
        timeout=30,
    )


def test_every_spelling_of_a_key_identifies_the_same_configured_key() -> None:
    checker = KeyChecker([sha256_hex("k0"), sha256_hex("k1")])
    assert {checker.identify(s) for s in SPELLINGS} == {sha256_hex("k1")}
    assert checker.identify("Bearer nope") is None and checker.identify("Basic k1") is None
    assert checker.check_authorization("bearer k1") and not checker.check_authorization(None)


def test_six_spellings_of_one_key_share_one_bucket(upstream: tuple[str, list[dict[str, Any]]]) -> None:
    limits = {"per_key_requests_per_s": 0.01, "per_key_burst": 2}
    auth = {"api_keys_sha256": [sha256_hex("k1"), sha256_hex("k2")]}
    with serve_in_thread(gateway_config([upstream[0]], limits=limits, auth=auth)) as gw:
        statuses = [_post(gw, spelling).status_code for spelling in SPELLINGS]
        other_key = _post(gw, "Bearer k2").status_code
        buckets = len(gw.gateway.limiter.buckets or ())
    assert statuses == [200, 200, 429, 429, 429, 429]
    assert other_key == 200  # another configured key has its own bucket
    assert buckets == 2


def test_made_up_tokens_with_auth_off_share_the_clients_bucket(upstream: tuple[str, list[dict[str, Any]]]) -> None:
    limits = {"per_key_requests_per_s": 0.01, "per_key_burst": 2}
    with serve_in_thread(gateway_config([upstream[0]], limits=limits)) as gw:
        statuses = [_post(gw, f"Bearer made-up-{i}").status_code for i in range(4)]
        statuses.append(_post(gw).status_code)  # and no token at all: the same client
        buckets = len(gw.gateway.limiter.buckets or ())
    assert statuses == [200, 200, 429, 429, 429]
    assert buckets == 1


def test_forwarded_for_is_believed_only_from_trusted_proxies(upstream: tuple[str, list[dict[str, Any]]]) -> None:
    """The test client's peer is 127.0.0.1: trusted in one gateway, not in the other."""
    base = {"per_key_requests_per_s": 0.01, "per_key_burst": 1, "client_identity": "forwarded"}
    trusted = gateway_config([upstream[0]], limits={**base, "trusted_proxies": ["127.0.0.0/8"]})
    untrusted = gateway_config([upstream[0]], limits={**base, "trusted_proxies": ["10.0.0.0/8"]})
    with serve_in_thread(trusted) as gw:
        # two clients behind the proxy: each its own bucket; a spoofed left-most hop is ignored
        first = [_post(gw, **{"X-Forwarded-For": "203.0.113.7"}).status_code for _ in range(2)]
        second = _post(gw, **{"X-Forwarded-For": "198.51.100.9"}).status_code
        spoofed = _post(gw, **{"X-Forwarded-For": "1.1.1.1, 203.0.113.7"}).status_code
    with serve_in_thread(untrusted) as gw:
        ignored = [_post(gw, **{"X-Forwarded-For": f"203.0.113.{i}"}).status_code for i in range(3)]
    assert first == [200, 429] and second == 200
    assert spoofed == 429  # the client wrote 1.1.1.1; the proxy saw 203.0.113.7 (already spent)
    assert ignored == [200, 429, 429]  # an untrusted peer's header is not believed: one bucket


def test_client_identity_picks_the_right_most_untrusted_hop() -> None:
    ident = ClientIdentity("forwarded", trusted_proxies=["10.0.0.0/8", "fd00::/8"])
    xff = [(b"x-forwarded-for", b"6.6.6.6, 203.0.113.7"), (b"X-Forwarded-For", b"10.1.2.3")]
    assert ident.address(xff, ("10.9.9.9", 1234)) == "203.0.113.7"  # 10.1.2.3 is a proxy too
    assert ident.address(xff, ("192.0.2.1", 1234)) == "192.0.2.1"  # untrusted peer: header ignored
    assert ident.address([(b"x-forwarded-for", b"10.0.0.5")], ("10.9.9.9", 1)) == "10.0.0.5"  # all trusted
    assert ident.address([(b"x-forwarded-for", b"203.0.113.7:5555")], ("10.9.9.9", 1)) == "203.0.113.7"
    assert ident.address([(b"x-forwarded-for", b"[2001:db8::1]:443")], ("10.9.9.9", 1)) == "2001:db8::/64"
    assert ident.address([], ("10.9.9.9", 1)) == "10.9.9.9"  # no header from a proxy: the proxy itself
    peer = ClientIdentity("peer")
    assert peer.address(xff, ("2001:db8::1:2", 1)) == peer.address([], ("2001:db8::ffff", 1)) == "2001:db8::/64"
    assert peer.address(xff, ("::ffff:192.0.2.1", 1)) == "192.0.2.1"
    assert peer.key(None, [], None) == "a:-" and peer.key("ab" * 32, [], ("1.2.3.4", 1)) == "k:" + "ab" * 16


def test_forwarded_without_trusted_proxies_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="trusted_proxies"):
        gateway_config(["http://127.0.0.1:1"], limits={"client_identity": "forwarded"})
    with pytest.raises(ConfigError, match="CIDR"):
        gateway_config(["http://127.0.0.1:1"], limits={"trusted_proxies": ["not-an-ip"]})


def test_the_bucket_table_stays_bounded() -> None:
    buckets = LocalBuckets(rate=1.0, burst=1.0, max_keys=100)
    for i in range(1000):
        buckets.take(f"a:{i}", 0.0)
    assert len(buckets) == 100
