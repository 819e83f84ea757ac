"""End to end through the gateway with the openai SDK against real simulated replicas."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from gw_helpers import MODEL, chat, client, running_gateway, wait_for

from gateway.http.server import RunningGateway

_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


@pytest.fixture(scope="module")
def gw(sim_urls: list[str]) -> Iterator[RunningGateway]:
    with running_gateway(sim_urls) as running:
        yield running


@pytest.fixture(scope="module")
def gw_one(sim_urls: list[str]) -> Iterator[RunningGateway]:
    """A gateway over replica 0 only, to compare byte for byte with going direct."""
    with running_gateway(sim_urls[:1]) as running:
        yield running


def test_chat_non_streaming(gw: RunningGateway) -> None:
    raw = client(gw).chat.completions.with_raw_response.create(model=MODEL, messages=chat("hello there"), max_tokens=8)
    reply = raw.parse()
    assert reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens_details.cached_tokens is not None
    assert raw.headers["x-prefix-gateway-route"] == "main"
    assert raw.headers["x-prefix-gateway-replica"] in {"r0", "r1", "r2", "r3"}
    assert re.fullmatch(r"[0-9a-f]{32}", raw.headers["x-request-id"])


def test_completions_streaming_and_not(gw: RunningGateway) -> None:
    c = client(gw)
    reply = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert reply.choices[0].text and reply.usage.completion_tokens == 5
    chunks = list(c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == reply.choices[0].text
    assert all(ch.usage is None for ch in chunks)


def test_chat_streaming_with_usage(gw: RunningGateway) -> None:
    stream = client(gw).chat.completions.create(
        model=MODEL, messages=chat("stream me"), max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def _sse(base: str, payload: dict[str, object]) -> bytes:
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=payload, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return _VOLATILE.sub(rb'"\1":X', b"".join(response.iter_bytes()))


@pytest.mark.parametrize("include_usage", [None, False, True])
def test_stream_bytes_equal_direct(gw_one: RunningGateway, sim_urls: list[str], include_usage: bool | None) -> None:
    """With or without include_usage the client gets exactly the replica's chunks (the gateway's own
    usage request is stripped again)."""
    payload: dict[str, object] = {"model": MODEL, "messages": chat("compare bytes"), "max_tokens": 7, "stream": True}
    if include_usage is not None:
        payload["stream_options"] = {"include_usage": include_usage}
    direct = _sse(sim_urls[0], payload)
    through = _sse(gw_one.url, payload)
    assert through == direct
    assert (b'"usage":{' in through) is bool(include_usage)


def test_stream_usage_is_recorded_even_when_client_did_not_ask(gw_one: RunningGateway) -> None:
    before = gw_one.gateway.stats.by_route["main"].prompt_tokens if "main" in gw_one.gateway.stats.by_route else 0
    list(client(gw_one).chat.completions.create(model=MODEL, messages=chat("count me"), max_tokens=3, stream=True))

    def recorded() -> bool:  # the outcome is recorded after the last byte: the client can be faster
        tally = gw_one.gateway.stats.by_route.get("main")
        return tally is not None and tally.prompt_tokens > before

    wait_for(recorded, what="the stream's usage in the stats")


def test_models_is_the_union_of_healthy_replicas(gw: RunningGateway) -> None:
    models = client(gw).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_embeddings(gw: RunningGateway) -> None:
    result = client(gw).embeddings.create(model=MODEL, input=["alpha", "beta"])
    assert len(result.data) == 2 and len(result.data[0].embedding) > 0
    assert result.usage.prompt_tokens > 0


def test_request_id_is_accepted_and_echoed(gw: RunningGateway) -> None:
    raw = client(gw).chat.completions.with_raw_response.create(
        model=MODEL, messages=chat("id"), max_tokens=1, extra_headers={"x-request-id": "my-id-123"}
    )
    assert raw.headers["x-request-id"] == "my-id-123"


def test_health_ready_and_openapi(gw: RunningGateway) -> None:
    assert httpx.get(f"{gw.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{gw.url}/ready")
    assert ready.status_code == 200 and ready.json()["routes"]["main"]["healthy_replicas"] == 4
    assert httpx.get(f"{gw.url}/openapi.json").status_code == 404  # closed unless server.expose_openapi


def test_openapi_when_exposed(echo_url: str) -> None:
    with running_gateway([echo_url], server={"port": 0, "expose_openapi": True}) as gw:
        paths = httpx.get(f"{gw.url}/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models"} <= set(paths)


def test_unknown_fields_and_headers_pass_through(echo_url: str) -> None:
    """vLLM's extra sampling parameters reach the replica untouched; so do the request id and,
    where the config says so, the client's auth."""
    with running_gateway([echo_url], upstream={"forward_client_authorization": True}) as gw:
        c = client(gw, api_key="client-key")
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=chat("x"),
            extra_body={"top_k": 5, "repetition_penalty": 1.1, "guided_json": {"type": "object"}},
            extra_headers={"x-request-id": "rid-1"},
        )
        seen = raw.parse().model_extra["echo"]
    assert seen["body"]["top_k"] == 5
    assert seen["body"]["repetition_penalty"] == 1.1
    assert seen["body"]["guided_json"] == {"type": "object"}
    assert seen["headers"]["x-request-id"] == "rid-1"
    assert seen["headers"]["authorization"] == "Bearer client-key"


def test_replica_api_key_replaces_client_auth(echo_url: str) -> None:
    replicas = [{"name": "e", "url": echo_url, "api_key": "upstream-secret"}]
    with running_gateway([echo_url], replicas=replicas) as gw:
        seen = client(gw).chat.completions.create(model=MODEL, messages=chat("x")).model_extra["echo"]
    assert seen["headers"]["authorization"] == "Bearer upstream-secret"


def test_response_headers_can_be_turned_off(sim_urls: list[str]) -> None:
    with running_gateway(sim_urls[:1], server={"response_headers": False}) as gw:
        raw = client(gw).chat.completions.with_raw_response.create(model=MODEL, messages=chat("x"), max_tokens=1)
    assert "x-prefix-gateway-replica" not in raw.headers
    assert "x-prefix-gateway-route" not in raw.headers
    assert "x-request-id" in raw.headers


@pytest.mark.slow
def test_client_keys_protect_v1(sim_urls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_API_KEYS", "good-key")
    with running_gateway(sim_urls[:1]) as gw:
        with pytest.raises(openai.AuthenticationError) as info:
            client(gw, api_key="bad-key").chat.completions.create(model=MODEL, messages=chat("x"))
        assert info.value.body["code"] == "invalid_api_key"
        ok = client(gw, api_key="good-key").chat.completions.create(model=MODEL, messages=chat("x"), max_tokens=1)
        assert ok.choices
