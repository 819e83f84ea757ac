"""Hostile or odd input and odd replica answers end in OpenAI-shaped errors, never a 500 or a leak."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
from openai import OpenAI

from gateway.http.server import RunningGateway, serve_in_thread
from gateway.proxy.usage import StreamRelay
from tests.configs import gateway_config
from tests.hardening.hostile_upstream import MODEL, run_upstream
from tests.polling import wait_for

PREFIX_ROUTE = [{"name": "main", "policy": "prefix"}]


def _post(gw: RunningGateway, body: bytes | dict[str, Any], **headers: str) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{gw.url}/v1/chat/completions",
        content=data,
        headers={"content-type": "application/json", **headers},
        timeout=30,
    )


def _openai_error(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert {"message", "type", "code"} <= set(error), error
    return error


@pytest.fixture(scope="module")
def gw(upstream: tuple[str, list[dict[str, Any]]]) -> Any:
    with serve_in_thread(gateway_config([upstream[0]], routes=PREFIX_ROUTE)) as running:
        yield running


@pytest.mark.parametrize("depth", [200, 990, 5000])
def test_deeply_nested_json_is_a_400(gw: RunningGateway, depth: int) -> None:
    nested = "[" * depth + "]" * depth
    raw = ('{"model":"demo-model","messages":[{"role":"user","content":"x"}],"extra":' + nested + "}").encode()
    response = _post(gw, raw)
    assert response.status_code == 400
    assert _openai_error(response)["code"] == "invalid_json"


def test_shallow_nesting_still_passes(gw: RunningGateway) -> None:
    schema: Any = {"type": "string"}
    for _ in range(20):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "guided_json": schema}
    assert _post(gw, body).status_code == 200


@pytest.mark.parametrize("field", ["model", "content", "role"])
def test_lone_surrogate_is_not_a_500(gw: RunningGateway, field: str) -> None:
    message = {"role": "user", "content": "hello there " * 40}
    body: dict[str, Any] = {"model": MODEL, "messages": [message]}
    if field == "model":
        body["model"] = "demo\ud800model"
    else:
        message[field] = message[field] + "\udfff"
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as a \\u escape
    response = _post(gw, raw)
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        _openai_error(response)


def test_path_cannot_forge_access_log_lines(gw: RunningGateway, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="prefix_gateway.access"):
        response = httpx.get(f"{gw.url}/v1/x%0A2026-01-01 INFO forged%0D%0Aline%22", timeout=10)
        assert response.status_code == 404

        def line() -> str | None:
            found = [
                r.getMessage()
                for r in caplog.records
                if r.name == "prefix_gateway.access" and "forged" in r.getMessage()
            ]
            return found[0] if found else None

        from tests.polling import wait_for

        text = wait_for(line, what="the access line")
    assert "\n" not in text and "\r" not in text
    assert '\\x0a2026-01-01 INFO forged\\x0d\\x0aline\\"' in text


def test_client_authorization_is_not_forwarded_by_default(
    gw: RunningGateway, upstream: tuple[str, list[dict[str, Any]]]
) -> None:
    client = OpenAI(base_url=gw.openai_base_url, api_key="client-secret", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    seen = raw.parse().model_extra["echo"]["headers"]
    assert "authorization" not in seen


def test_route_can_forward_client_authorization_and_replica_key_is_sent_otherwise() -> None:
    with run_upstream() as (url, _seen):
        routes = [
            {
                "name": "fwd",
                "policy": "least_loaded",
                "match": {"models": ["fwd-*"]},
                "forward_client_authorization": True,
            },
            {"name": "main", "policy": "least_loaded"},
        ]
        replicas = [{"name": "r0", "url": url, "api_key": "replica-key"}]
        with serve_in_thread(gateway_config([url], routes=routes, replicas=replicas)) as gw:
            client = OpenAI(base_url=gw.openai_base_url, api_key="client-secret", max_retries=0)
            forwarded = client.chat.completions.with_raw_response.create(
                model="fwd-model", messages=[{"role": "user", "content": "x"}]
            )
            own = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}]
            )
    assert forwarded.parse().model_extra["echo"]["headers"]["authorization"] == "Bearer client-secret"
    assert own.parse().model_extra["echo"]["headers"]["authorization"] == "Bearer replica-key"


def test_openapi_and_docs_are_closed_by_default(gw: RunningGateway) -> None:
    for path in ("/openapi.json", "/docs", "/redoc"):
        response = httpx.get(gw.url + path, timeout=10)
        assert response.status_code == 404, path
        _openai_error(response)


def test_openapi_can_be_exposed(upstream: tuple[str, list[dict[str, Any]]]) -> None:
    with serve_in_thread(gateway_config([upstream[0]], server={"port": 0, "expose_openapi": True})) as gw:
        paths = httpx.get(f"{gw.url}/openapi.json", timeout=10).json()["paths"]
        assert httpx.get(f"{gw.url}/docs", timeout=10).status_code == 200
    assert "/v1/chat/completions" in paths


def test_background_gets_send_the_replica_key_and_models_checks_client_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARDEN_TEST_CLIENT_KEYS", "client-key")
    with run_upstream(api_key="replica-key") as (url, seen):
        replicas = [{"name": "r0", "url": url, "api_key": "replica-key"}]
        config = gateway_config([url], replicas=replicas, auth={"api_keys_env": "HARDEN_TEST_CLIENT_KEYS"})
        with serve_in_thread(config) as gw:
            anonymous = httpx.get(f"{gw.url}/v1/models", timeout=10)
            listed = httpx.get(f"{gw.url}/v1/models", headers={"Authorization": "Bearer client-key"}, timeout=10)
    assert anonymous.status_code == 401 and _openai_error(anonymous)["code"] == "invalid_api_key"
    assert [m["id"] for m in listed.json()["data"]] == [MODEL]
    background = [r for r in seen if r["path"] in ("/health", "/v1/models", "/metrics")]
    assert background and all(r["headers"].get("authorization") == "Bearer replica-key" for r in background)


@pytest.mark.slow
def test_continuous_usage_without_include_usage_gets_no_usage(sim_url: str) -> None:
    with serve_in_thread(gateway_config([sim_url])) as gw:
        client = OpenAI(base_url=gw.openai_base_url, api_key="x", max_retries=0)
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "count"}],
                max_tokens=5,
                stream=True,
                stream_options={"continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            )
        )
        direct = OpenAI(base_url=sim_url + "/v1", api_key="x", max_retries=0)
        both = list(
            direct.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "count"}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            )
        )
        sim_alone = list(
            direct.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "count"}],
                max_tokens=5,
                stream=True,
                stream_options={"continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            )
        )
    assert chunks and all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)  # no usage-only chunk either
    # the simulator, like vLLM: continuous usage only together with include_usage
    assert all(c.usage is None for c in sim_alone)
    assert sum(1 for c in both if c.usage is not None) > 1


def test_crlf_stream_split_after_cr_is_framed_and_stripped(gw: RunningGateway) -> None:
    with httpx.stream(
        "POST",
        f"{gw.url}/v1/chat/completions",
        json={"model": "crlf-stream", "messages": [{"role": "user", "content": "x"}], "stream": True},
        timeout=30,
    ) as response:
        body = response.read()
    events = [e for e in body.split(b"\r\n\r\n") if e]
    assert events[-1] == b"data: [DONE]"
    payloads = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert len(payloads) == 1 and "usage" not in payloads[0]  # the injected usage chunk and null are gone


def test_a_stream_the_client_closes_after_done_is_complete_with_its_usage(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    """The official SDK stops reading at ``[DONE]`` and closes, often before the replica ends its
    stream: the request completed (200, its usage counted), it is no client disconnect (499)."""
    with serve_in_thread(gateway_config([upstream[0]], routes=PREFIX_ROUTE)) as gw:
        _stream_and_close(gw)


def _stream_and_close(gw: RunningGateway) -> None:
    client = OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="linger-after-done",
        messages=[{"role": "user", "content": "x"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)  # the SDK returns at [DONE] and closes the response
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details.cached_tokens == 256

    def counted() -> str | None:
        text = httpx.get(f"{gw.url}/metrics", timeout=10).text
        line = next((x for x in text.splitlines() if x.startswith("prefix_gateway_cached_tokens_total{")), None)
        return line

    wait_for(lambda: counted() is not None, 10, what="the stream's outcome")
    metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
    assert float(counted().rsplit(" ", 1)[1]) >= 256  # type: ignore[union-attr]
    assert 'status_class="4xx"' not in metrics  # not a 499


def test_relay_detects_separator_from_a_complete_event() -> None:
    relay = StreamRelay(strip_usage=True)
    first = relay.feed(b'data: {"choices":[{"index":0}],"usage":null}\r')
    second = relay.feed(b'\n\r\ndata: {"choices":[],"usage":{"prompt_tokens":3}}\r\n\r\n')
    assert first == b""
    assert second == b'data: {"choices":[{"index":0}]}\r\n\r\n'
    assert relay.usage is not None and relay.usage.prompt_tokens == 3


def test_replica_redirect_becomes_an_openai_error(gw: RunningGateway) -> None:
    response = _post(gw, {"model": "redirect", "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 502
    assert "location" not in response.headers
    assert _openai_error(response)["code"] == "upstream_redirect"
