"""Bad input and failures come back as OpenAI-shaped errors with the right status, never a traceback."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
from gw_helpers import MODEL, chat, client, metric_sum, running_gateway, set_faults, wait_for

from gateway.http.server import RunningGateway
from gateway.sim.launcher import run_replicas


@pytest.fixture(scope="module")
def gw(sim_urls: list[str]) -> Iterator[RunningGateway]:
    with running_gateway(sim_urls[:2], server={"max_body_bytes": 4096}) as running:
        yield running


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"]
    assert "Traceback" not in response.text
    return error


def test_malformed_json_is_400(gw: RunningGateway) -> None:
    response = httpx.post(f"{gw.url}/v1/chat/completions", content=b'{"model": "demo-model", "messages": [', timeout=5)
    error = assert_openai_error(response, 400)
    assert error["code"] == "invalid_json"


def test_wrong_types_are_400_through_the_sdk(gw: RunningGateway) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(gw).chat.completions.create(model=MODEL, messages="not a list")  # type: ignore[arg-type]
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        client(gw).chat.completions.create(model=MODEL, messages=chat("x"), max_tokens="lots")  # type: ignore[arg-type]


def test_body_over_limit_is_413(gw: RunningGateway) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client(gw).chat.completions.create(model=MODEL, messages=chat("x" * 10_000))
    assert info.value.status_code == 413
    assert info.value.body["code"] == "request_too_large"
    chunked = httpx.post(
        f"{gw.url}/v1/chat/completions", content=iter([b'{"model":"demo-model","messages":"', b"x" * 8000, b'"}'])
    )
    assert_openai_error(chunked, 413)


def test_unknown_model_is_404(gw: RunningGateway, sim_urls: list[str]) -> None:
    routes = [{"name": "only-demo", "match": {"models": [MODEL]}}]
    with running_gateway(sim_urls[:1], routes=routes) as strict, pytest.raises(openai.NotFoundError) as info:
        client(strict).chat.completions.create(model="gpt-17", messages=chat("x"))
    assert info.value.body["code"] == "model_not_found"
    assert "gpt-17" in info.value.body["message"]


def test_unknown_model_on_a_catch_all_route_passes_the_replica_404_through(gw: RunningGateway) -> None:
    with pytest.raises(openai.NotFoundError):
        client(gw).chat.completions.create(model="gpt-17", messages=chat("x"))


def test_wrong_method_and_unknown_path_are_openai_shaped(gw: RunningGateway) -> None:
    assert assert_openai_error(httpx.get(f"{gw.url}/v1/chat/completions"), 405)["code"] == "method_not_allowed"
    assert assert_openai_error(httpx.get(f"{gw.url}/v1/nothing-here"), 404)["code"] == "not_found"


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_no_healthy_replica_is_503_with_a_clear_message() -> None:
    with running_gateway([closed_port_url(), closed_port_url()]) as gw:
        with pytest.raises(openai.InternalServerError) as info:
            client(gw).chat.completions.create(model=MODEL, messages=chat("x"))
        assert info.value.status_code == 503
        message = info.value.body["message"]
        assert "no healthy replica for route 'main'" in message
        assert "127.0.0.1" not in message  # replica names only, never addresses
        ready = httpx.get(f"{gw.url}/ready")
        assert ready.status_code == 503 and ready.json()["routes"]["main"]["healthy_replicas"] == 0


@pytest.mark.parametrize("status", [400, 500])
def test_replica_error_status_and_body_pass_through(sims: list[str], status: int) -> None:
    set_faults(sims[3], error_rate=1.0, error_status=status)
    direct = httpx.post(f"{sims[3]}/v1/chat/completions", json={"model": MODEL, "messages": chat("x")})
    assert direct.status_code == status
    with running_gateway(sims[3:4], upstream={"retry_on_status": []}) as gw:
        through = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": MODEL, "messages": chat("x")})
    assert through.status_code == status
    assert through.json() == direct.json()


@pytest.fixture(scope="module")
def slow_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A replica in real time with long outputs: requests stay running until they are aborted."""
    with run_replicas(
        1,
        time_scale=1.0,
        max_output_tokens=100_000,
        decode_ms_per_token=5,
        disable_uvicorn_access_log=True,
        disable_log_stats=True,
        log_dir=tmp_path_factory.mktemp("slow"),
    ) as urls:
        yield urls[0]


def running_on(url: str) -> float:
    return metric_sum(httpx.get(f"{url}/metrics").text, "vllm:num_requests_running")


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.slow
def test_client_disconnect_cancels_the_upstream_request(
    slow_sim: str, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefix_gateway.access")
    with running_gateway([slow_sim]) as gw:
        payload = {"model": MODEL, "messages": chat("tell me everything"), "max_tokens": 20_000, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=payload, timeout=30) as response:
                assert response.status_code == 200
                chunks = response.iter_bytes()  # keep a reference: a dropped iterator closes the stream
                assert next(chunks).startswith(b"data: ")
                assert running_on(slow_sim) == 1
            # leaving the block closes the connection mid-stream
        else:
            done = threading.Event()

            def call() -> None:
                with contextlib.suppress(httpx.TimeoutException):
                    httpx.post(f"{gw.url}/v1/chat/completions", json=payload, timeout=1.0)
                done.set()

            threading.Thread(target=call, daemon=True).start()
            wait_for(lambda: running_on(slow_sim) == 1, what="the request to run upstream")
            wait_for(done.is_set, what="the client to give up")
        wait_for(lambda: running_on(slow_sim) == 0, timeout=10, what="the upstream request to be aborted")
        wait_for(lambda: gw.gateway.replicas["r0"].in_flight == 0, what="the gateway to release its slot")
        text = httpx.get(f"{gw.url}/metrics").text
        assert metric_sum(text, "prefix_gateway_errors_total", kind="client_disconnect") == 1
    access = [r.getMessage() for r in caplog.records if r.name == "prefix_gateway.access"]
    assert any('"POST /v1/chat/completions" 499' in line and "error=client_disconnect" in line for line in access)


@pytest.mark.parametrize(
    ("fault", "upstream", "kind"),
    [
        ({"drop_after_chunks": 3}, {}, "upstream_broken"),
        ({"stall_after_chunks": 3}, {"read_timeout_s": 0.3}, "upstream_timeout"),
    ],
)
@pytest.mark.slow
def test_upstream_failing_mid_stream_ends_the_stream_with_an_error_event(
    sims: list[str], fault: dict[str, int], upstream: dict[str, float], kind: str
) -> None:
    set_faults(sims[2], **fault)
    with running_gateway(sims[2:3], upstream=upstream) as gw:
        stream = client(gw).chat.completions.create(model=MODEL, messages=chat("x"), max_tokens=10, stream=True)
        received = []
        with pytest.raises(openai.APIError, match="upstream stream failed: replica 'r0'") as info:
            for chunk in stream:
                received.append(chunk)
        assert "127.0.0.1" not in str(info.value)  # the detail is logged, not sent
        assert info.value.code == "upstream_stream_failed"  # string codes, like every other error
        assert 0 < len(received) <= 3  # what arrived before the failure was passed on
        text = httpx.get(f"{gw.url}/metrics").text
        assert metric_sum(text, "prefix_gateway_errors_total", kind=kind) == 1
        assert gw.gateway.replicas["r0"].in_flight == 0


def test_lone_surrogate_in_a_rewritten_body_reaches_the_replica(gw: RunningGateway, sim_urls: list[str]) -> None:
    """JSON allows ``\\ud800``, UTF-8 does not: re-serializing (stream_options → include_usage) must not crash.

    The replica's own answer (the simulator, like vLLM's pydantic, rejects it with a 400) comes back.
    """
    content = b'[{"role":"user","content":"a\\ud800b"}],"max_tokens":3,"stream":true,"stream_options":{}}'
    raw = b'{"model":"demo-model","messages":' + content
    direct = httpx.post(f"{sim_urls[0]}/v1/chat/completions", content=raw, timeout=10)
    through = httpx.post(f"{gw.url}/v1/chat/completions", content=raw, timeout=10)
    assert through.status_code == direct.status_code < 500, through.text
    assert through.json() == direct.json()


def test_an_unexpected_exception_becomes_an_openai_500(
    gw: RunningGateway, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_prepare(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug with internal detail")

    monkeypatch.setattr(gw.gateway, "prepare", broken_prepare)
    caplog.set_level(logging.ERROR, logger="prefix_gateway.proxy")
    response = httpx.post(
        f"{gw.url}/v1/chat/completions", json={"model": MODEL, "messages": chat("secret prompt")}, timeout=10
    )
    error = assert_openai_error(response, 500)
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    assert "internal detail" not in response.text
    request_id = response.headers["x-request-id"]
    assert request_id in error["message"]
    logged = [r for r in caplog.records if r.name == "prefix_gateway.proxy" and r.exc_info]
    assert logged and request_id in logged[0].getMessage()
    assert not any("secret prompt" in r.getMessage() for r in caplog.records)
    text = httpx.get(f"{gw.url}/metrics").text
    assert metric_sum(text, "prefix_gateway_errors_total", kind="internal") >= 1
