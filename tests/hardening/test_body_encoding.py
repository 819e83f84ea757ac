"""UTF-16 and UTF-32 JSON bodies (which ``json.loads`` accepts) are served like UTF-8 ones (issue 25, item 8).

The gateway adds ``stream_options.include_usage`` to a stream by splicing bytes into the
client's body; spliced into UTF-16 it made the body unreadable and the replica refused it.
The openai SDK only sends UTF-8, so these requests are raw HTTP against a simulated replica.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from gateway.http.server import RunningGateway, serve_in_thread
from gateway.proxy.parse import as_utf8
from tests.configs import gateway_config

BODY = {"model": "demo-model", "messages": [{"role": "user", "content": "héllo 😀"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def gw(sim_url: str) -> Iterator[RunningGateway]:
    with serve_in_thread(gateway_config([sim_url], routes=[{"name": "main", "policy": "prefix"}])) as running:
        yield running


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-8-sig"])
def test_stream_with_a_non_utf8_body_gets_usage_added_and_stripped(gw: RunningGateway, encoding: str) -> None:
    data = json.dumps({**BODY, "stream": True}, ensure_ascii=False).encode(encoding)
    before = gw.gateway.stats.by_route["main"].as_dict() if "main" in gw.gateway.stats.by_route else {}
    with httpx.stream(
        "POST",
        f"{gw.url}/v1/chat/completions",
        content=data,
        headers={"content-type": "application/json"},
        timeout=30,
    ) as response:
        text = response.read().decode()
    assert response.status_code == 200, text
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all(c.get("usage") is None for c in chunks)  # not asked for: stripped
    # the gateway did read the usage it asked for (the splice reached the replica intact)
    after = gw.gateway.stats.by_route["main"].as_dict()
    assert after.get("prompt_tokens", 0) > before.get("prompt_tokens", 0), after


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32-be"])
def test_non_stream_non_utf8_body_is_served(gw: RunningGateway, encoding: str) -> None:
    response = httpx.post(
        f"{gw.url}/v1/chat/completions",
        content=json.dumps(BODY, ensure_ascii=False).encode(encoding),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 0


def test_broken_utf16_is_a_400(gw: RunningGateway) -> None:
    data = json.dumps(BODY).encode("utf-16-le")[:-1]  # an odd byte count: no whole code unit at the end
    response = httpx.post(
        f"{gw.url}/v1/chat/completions", content=data, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_as_utf8_agrees_with_json_loads() -> None:
    text = '{"a":"\ud800 é 😀"}'
    for encoding in ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"):
        raw = text.encode(encoding, "surrogatepass")
        assert json.loads(as_utf8(raw)) == json.loads(raw)
    utf8 = text.encode("utf-8", "surrogatepass")
    assert as_utf8(utf8) is utf8  # UTF-8 is not copied
