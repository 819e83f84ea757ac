"""The picker's per-stream state machine, driven with hand-made ext_proc messages (no Envoy, no gRPC)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.config import parse_config, quick_config
from gateway.epp import messages as m
from gateway.epp.endpoints import endpoint_of
from gateway.epp.stream import PickerStream
from gateway.service import Gateway
from tests.epp import envoy_messages as em

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(1, 5)]


@pytest.fixture
def gw() -> Gateway:
    return Gateway(quick_config(URLS))


async def run(gw: Gateway, *messages: Any) -> tuple[PickerStream, list[list[Any]]]:
    stream = PickerStream(gw)
    outs = [await stream.handle(message) for message in messages]
    return stream, outs


def in_flight(gw: Gateway) -> list[int]:
    return [r.in_flight for r in gw.replicas.values()]


async def test_a_chat_request_is_picked_answered_and_counted(gw: Gateway) -> None:
    body = em.chat(max_tokens=4)
    stream, (headers, picked) = await run(gw, em.request_headers(), em.request_body(body))
    assert headers == []  # the headers wait for the body: the pick needs it
    header, meta = em.picked(picked)
    assert header == meta  # the protocol: header and envoy.lb metadata identical
    endpoints = header.split(",")
    assert endpoints[0] in ENDPOINTS and len(endpoints) == 1 + gw.config.upstream.max_retries
    assert len(set(endpoints)) == len(endpoints) and set(endpoints) <= set(ENDPOINTS)
    sent, end, _ = em.body_out(picked)
    assert json.loads(sent) == body and end
    assert sum(in_flight(gw)) == 1
    primary = endpoints[0]
    out = await stream.handle(em.response_headers(served=primary))
    assert out[0].response_headers.response.header_mutation.remove_headers == [m.SERVED]
    out = await stream.handle(em.response_body(em.completion_reply(40, 32)))
    relayed, end, _ = em.body_out(out, "response_body")
    assert json.loads(relayed)["usage"]["prompt_tokens"] == 40 and end
    stream.close()
    assert sum(in_flight(gw)) == 0
    tally = gw.stats.by_route["default"]
    assert (tally.requests, tally.errors, tally.cached_tokens, tally.prompt_tokens) == (1, 0, 32, 40)
    assert tally.predicted_requests == 1  # the prefix policy's prediction is counted as in proxy mode


async def test_the_subset_hint_limits_the_pick_and_the_fallbacks(gw: Gateway) -> None:
    allowed = ENDPOINTS[2:]
    for i in range(8):
        _, (_, picked) = await run(gw, em.request_headers(subset=allowed), em.request_body(em.chat(f"q{i}")))
        header, _ = em.picked(picked)
        assert set(header.split(",")) <= set(allowed)


async def test_a_subset_with_no_replica_is_a_503(gw: Gateway) -> None:
    stream, (_, out) = await run(gw, em.request_headers(subset=["192.168.9.9:1"]), em.request_body(em.chat()))
    status, body = em.immediate(out)
    assert status == 503 and body["error"]["code"] == "no_healthy_replica"
    stream.close()
    assert sum(in_flight(gw)) == 0


async def test_the_replica_that_served_is_credited_not_the_pick(gw: Gateway) -> None:
    stream, (_, picked) = await run(gw, em.request_headers(), em.request_body(em.chat("served elsewhere")))
    primary, fallback = em.picked(picked)[0].split(",")[:2]
    await stream.handle(em.response_headers(served=fallback, in_metadata=True))
    by_endpoint = {e: r for e, r in zip(ENDPOINTS, gw.replicas.values(), strict=True)}
    assert by_endpoint[fallback].in_flight == 1 and by_endpoint[primary].in_flight == 0
    await stream.handle(em.response_body(em.completion_reply()))
    stream.close()
    assert stream.outcome.replica == by_endpoint[fallback].name and stream.outcome.retries == 1
    assert sum(in_flight(gw)) == 0
    # the next identical prompt goes where it was really computed
    _, (_, again) = await run(gw, em.request_headers(), em.request_body(em.chat("served elsewhere")))
    assert em.picked(again)[0].split(",")[0] == fallback


async def test_a_large_body_is_sent_back_in_chunks_under_64_kib(gw: Gateway) -> None:
    body = em.chat("word " * 60_000)
    raw = json.dumps(body).encode()
    half = len(raw) // 2
    _, (_, nothing, picked) = await run(
        gw, em.request_headers(), em.request_body(raw[:half], end=False), em.request_body(raw[half:])
    )
    assert nothing == []
    sent, end, sizes = em.body_out(picked)
    assert sent == raw and end and len(sizes) >= 5 and max(sizes) <= m.BODY_CHUNK_BYTES


async def test_a_stream_gets_usage_added_and_stripped_again(gw: Gateway) -> None:
    stream, (_, picked) = await run(gw, em.request_headers(), em.request_body(em.chat(stream=True)))
    sent, _, _ = em.body_out(picked)
    assert json.loads(sent)["stream_options"] == {"include_usage": True}  # the picker asked for usage
    await stream.handle(em.response_headers(content_type="text/event-stream"))
    chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": None}
    usage = {
        "choices": [],
        "usage": {"prompt_tokens": 30, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 16}},
    }
    events = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()
    out = await stream.handle(em.response_body(events))
    relayed, end, _ = em.body_out(out, "response_body")
    assert (
        end and b'"usage"' not in relayed and relayed.endswith(b"data: [DONE]\n\n")
    )  # the client sees what it asked for
    stream.close()
    assert stream.outcome.cached_tokens == 16 and stream.outcome.ttft_s is not None


# -- bad input -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"not json", "invalid_json"),
        (b"[1, 2]", "invalid_json"),
        (b'{"model": "demo-model"}', "missing_required_parameter"),
    ],
)
async def test_a_bad_body_is_an_openai_shaped_400(gw: Gateway, raw: bytes, code: str) -> None:
    stream, (_, out) = await run(gw, em.request_headers(), em.request_body(raw))
    status, body = em.immediate(out)
    assert status == 400 and body["error"]["code"] == code and body["error"]["type"] == "invalid_request_error"
    stream.close()
    assert gw.stats.by_route["none"].errors == 1 and sum(in_flight(gw)) == 0


async def test_a_body_over_the_limit_is_a_413_as_soon_as_it_is_known() -> None:
    config = quick_config(URLS).model_dump(exclude_unset=True)
    config["server"] = {**config.get("server", {}), "max_body_bytes": 2000}
    gw = Gateway(parse_config(config, "test"))
    stream, (_, first, second) = await run(
        gw, em.request_headers(), em.request_body(b"x" * 1500, end=False), em.request_body(b"x" * 1500, end=False)
    )
    assert first == []
    status, body = em.immediate(second)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    stream.close()
    _, (out,) = await run(gw, em.request_headers(**{"content-length": "5000"}))
    assert em.immediate(out)[0] == 413  # a declared length over the limit: refused before any byte


@pytest.mark.parametrize(
    "messages",
    [
        [em.request_body(em.chat())],  # a body before any headers
        [em.request_headers(), em.response_body(b"{}")],  # a response before the request ended
        [em.ep.ProcessingRequest()],  # nothing set at all
        [em.request_headers(), em.request_headers()],  # headers twice
    ],
)
async def test_malformed_ext_proc_streams_get_an_error_not_a_crash(gw: Gateway, messages: list[Any]) -> None:
    stream, outs = await run(gw, *messages)
    status, body = em.immediate(outs[-1])
    assert status == 500 and "malformed ext_proc" in body["error"]["message"]
    stream.close()
    assert sum(in_flight(gw)) == 0


async def test_a_stream_cut_midway_releases_the_replica_and_counts_499(gw: Gateway) -> None:
    stream, (_, _picked) = await run(gw, em.request_headers(), em.request_body(em.chat(stream=True)))
    await stream.handle(em.response_headers(content_type="text/event-stream"))
    await stream.handle(em.response_body(b'data: {"choices": []}\n\n', end=False))
    assert sum(in_flight(gw)) == 1
    stream.close()  # Envoy cut the stream (the client left)
    assert sum(in_flight(gw)) == 0
    assert stream.outcome.status == 499 and stream.outcome.error_kind == "stream_cut"
    stream.close()  # idempotent: counted once
    assert gw.stats.by_route["default"].requests == 1


async def test_a_bare_upstream_error_becomes_openai_shaped(gw: Gateway) -> None:
    stream, (_, _picked) = await run(gw, em.request_headers(), em.request_body(em.chat()))
    out = await stream.handle(em.response_headers(503, content_type="text/plain"))
    mutation = out[0].response_headers.response.header_mutation
    assert "content-length" in mutation.remove_headers
    await stream.handle(em.response_body(b"upstream connect error", end=False))
    out = await stream.handle(em.response_body(b" or disconnect"))
    body, end, _ = em.body_out(out, "response_body")
    assert end and json.loads(body)["error"]["message"].startswith("replica ")
    stream.close()


async def test_a_non_inference_path_passes_through_unrouted(gw: Gateway) -> None:
    stream, (headers, body) = await run(gw, em.request_headers("/tokenize"), em.request_body(b'{"x": 1}'))
    assert headers[0].WhichOneof("response") == "request_headers"
    assert not headers[0].request_headers.response.header_mutation.set_headers  # no pick: Envoy's fallback LB
    assert em.body_out(body)[0] == b'{"x": 1}'
    stream.close()
    assert "default" not in gw.stats.by_route


async def test_client_keys_are_checked_and_never_reach_the_replica(gw: Gateway) -> None:
    from gateway.config import sha256_hex

    config = quick_config(URLS).model_dump(exclude_unset=True)
    config["auth"] = {"api_keys_sha256": [sha256_hex("sk-good")]}
    gw = Gateway(parse_config(config, "test"))
    _, (out,) = await run(gw, em.request_headers(authorization="Bearer sk-bad"))
    status, body = em.immediate(out)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    stream, (_, picked) = await run(gw, em.request_headers(authorization="Bearer sk-good"), em.request_body(em.chat()))
    mutation = picked[0].request_headers.response.header_mutation
    assert "authorization" in mutation.remove_headers  # the gateway's own key stays at the gateway
    assert stream.plan is not None and stream.plan.request.flow == "key:" + sha256_hex("sk-good")[:16]  # routing's flow


def _gateway(**sections: Any) -> Gateway:
    data = quick_config(URLS).model_dump(exclude_unset=True)
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return Gateway(parse_config(data, "test"))


async def test_over_the_per_key_rate_is_a_429_with_retry_after() -> None:
    gw = _gateway(limits={"per_key_requests_per_s": 0.01, "per_key_burst": 1})
    first, (_, picked) = await run(gw, em.request_headers(), em.request_body(em.chat()))
    assert em.picked(picked)
    stream, (out,) = await run(gw, em.request_headers())
    status, body = em.immediate(out)
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    headers = {h.header.key: h.header.raw_value for h in out[0].immediate_response.headers.set_headers}
    assert int(headers["retry-after"]) >= 1
    first.close()
    stream.close()


async def test_a_full_process_sheds_with_a_503() -> None:
    gw = _gateway(server={"max_concurrency": 1})
    holding, _ = await run(gw, em.request_headers(), em.request_body(em.chat()))
    shed, (out,) = await run(gw, em.request_headers())
    status, body = em.immediate(out)
    assert status == 503 and body["error"]["code"] == "server_overloaded"
    shed.close()
    holding.close()
    _, (_, again) = await run(gw, em.request_headers(), em.request_body(em.chat()))  # the slot came back
    assert em.picked(again)


async def test_each_request_gets_one_access_log_line_without_prompt_text(
    gw: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="prefix_gateway.access")
    stream, _ = await run(
        gw, em.request_headers(**{"x-request-id": "rid-7"}), em.request_body(em.chat("a secret prompt"))
    )
    await stream.handle(em.response_headers())
    await stream.handle(em.response_body(em.completion_reply(40, 32)))
    stream.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "prefix_gateway.access"]
    assert len(lines) == 1 and '"POST /v1/chat/completions" 200' in lines[0] and "rid=rid-7" in lines[0]
    assert "cached_tokens=32" in lines[0] and "secret" not in lines[0]


# -- flow control in the picker (gateway.flow: the same queue as proxy mode) -------------------
#: saturated at one request in flight per replica; nothing scraped counts (never scraped here)
ONE_PER_REPLICA = {"in_flight": 1, "queued_prefill_tokens": 0, "waiting": 0, "kv_cache_usage": 0}


def _flow_gateway(**route_flow: Any) -> Gateway:
    data = quick_config(URLS).model_dump(exclude_unset=True)
    data["flow_control"] = {"enabled": True, "saturation": ONE_PER_REPLICA}
    if route_flow:
        data["routes"][0]["flow_control"] = route_flow
    return Gateway(parse_config(data, "test"))


def _held(gw: Gateway) -> int:
    return sum(flow.queue.count for flow in gw.flow.routes.values())


async def _until(check: Any, what: str) -> None:
    """Poll ``check`` on the running loop with a deadline (the held pick runs as a task)."""
    import asyncio
    import time

    deadline = time.monotonic() + 5
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_saturated_route_holds_the_pick_until_a_replica_has_room() -> None:
    import asyncio

    gw = _flow_gateway()
    busy = [(await run(gw, em.request_headers(), em.request_body(em.chat(f"busy {i}"))))[0] for i in range(4)]
    assert in_flight(gw) == [1, 1, 1, 1]  # every replica at its limit: the route is saturated
    held = PickerStream(gw)
    assert await held.handle(em.request_headers()) == []
    pick = asyncio.ensure_future(held.handle(em.request_body(em.chat("held one"))))
    await _until(lambda: _held(gw) == 1, "the pick held in the queue")
    assert not pick.done() and sum(in_flight(gw)) == 4  # Envoy waits: nothing sent yet
    freed = busy[2]
    assert freed.attempt is not None
    endpoint = endpoint_of(freed.attempt.replica.url)
    await freed.handle(em.response_headers())
    await freed.handle(em.response_body(em.completion_reply(40, 0)))
    freed.close()  # its replica has room again: the held pick goes there
    out = await asyncio.wait_for(pick, 5)
    header, _ = em.picked(out)
    assert header.split(",")[0] == endpoint
    assert sum(in_flight(gw)) == 4 and _held(gw) == 0
    assert held.outcome.queued_s is not None and "placed on" in (held.outcome.queued_note or "")
    for stream in (*busy[:2], busy[3], held):
        stream.close()
    assert sum(in_flight(gw)) == 0  # flow control's charge is released once, with the attempt
    stats = gw.flow.snapshot()["default"]
    assert stats["queued"] == 1 and stats["dispatched"] == 1


async def test_a_held_pick_whose_stream_envoy_resets_leaves_the_queue() -> None:
    import asyncio

    gw = _flow_gateway()
    busy = [(await run(gw, em.request_headers(), em.request_body(em.chat(f"busy {i}"))))[0] for i in range(4)]
    held = PickerStream(gw)
    await held.handle(em.request_headers())
    pick = asyncio.ensure_future(held.handle(em.request_body(em.chat("held one"))))
    await _until(lambda: _held(gw) == 1, "the pick held in the queue")
    pick.cancel()  # grpc.aio cancels the servicer when Envoy resets the stream
    with pytest.raises(asyncio.CancelledError):
        await pick
    held.close()
    assert _held(gw) == 0
    for stream in busy:
        stream.close()
    assert sum(in_flight(gw)) == 0  # the cancelled pick never reached a replica


async def test_the_picker_forwards_the_flow_priority_where_the_route_says_so() -> None:
    gw = _flow_gateway(forward_priority=True)
    data = gw.config.model_dump()
    assert data["routes"][0]["flow_control"]["forward_priority"]
    _, (_, picked) = await run(gw, em.request_headers(**{"x-vllm-priority": "-99"}), em.request_body(em.chat("urgent")))
    sets = {h.header.key: h.header.raw_value for h in picked[0].request_headers.response.header_mutation.set_headers}
    assert sets["x-vllm-priority"] == b"0"  # the gateway's priority (0 here), not what the client sent


async def test_a_held_pick_past_its_ttl_is_an_openai_shaped_503_with_retry_after() -> None:
    data = quick_config(URLS).model_dump(exclude_unset=True)
    data["flow_control"] = {"enabled": True, "saturation": ONE_PER_REPLICA, "ttl_s": 0.2}
    gw = Gateway(parse_config(data, "test"))
    busy = [(await run(gw, em.request_headers(), em.request_body(em.chat(f"busy {i}"))))[0] for i in range(4)]
    held, (_, out) = await run(gw, em.request_headers(), em.request_body(em.chat("held one")))
    status, body = em.immediate(out)
    assert status == 503 and body["error"]["code"] == "flow_control_expired"
    headers = {h.header.key: h.header.raw_value for h in out[0].immediate_response.headers.set_headers}
    assert float(headers["retry-after"]) > 0
    held.close()
    for stream in busy:
        stream.close()
    assert sum(in_flight(gw)) == 0 and _held(gw) == 0
