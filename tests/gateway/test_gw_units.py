"""Small units of the request path: body checks, usage sniffing, the stream relay, auth, scrape parsing."""

from __future__ import annotations

import json

import pytest

from gateway.auth import KeyChecker
from gateway.config import sha256_hex
from gateway.errors import BadRequest, PayloadTooLarge
from gateway.proxy.parse import parse_body, read_body
from gateway.proxy.usage import StreamRelay, sniff_json_usage
from gateway.replicas.engine import parse_engine_metrics


# -- body checks ---------------------------------------------------------------------------
def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


@pytest.mark.parametrize(
    ("raw", "endpoint", "param"),
    [
        (b"{not json", "chat", None),
        (b"[1, 2]", "chat", None),
        (b"", "chat", None),
        (body(messages=[{"role": "user", "content": "x"}]), "chat", "model"),
        (body(model=3, messages=[]), "chat", "model"),
        (body(model="m"), "chat", "messages"),
        (body(model="m", messages="hi"), "chat", "messages"),
        (body(model="m", messages=[{"content": "no role"}]), "chat", "messages[0]"),
        (body(model="m", messages=[{"role": "user"}], stream="yes"), "chat", "stream"),
        (body(model="m", messages=[{"role": "user"}], max_tokens="10"), "chat", "max_tokens"),
        (body(model="m", messages=[{"role": "user"}], temperature="hot"), "chat", "temperature"),
        (body(model="m", prompt={"a": 1}), "completions", "prompt"),
        (body(model="m"), "completions", "prompt"),
        (body(model="m", input=[1.5]), "embeddings", "input"),
    ],
)
def test_bad_bodies_are_400(raw: bytes, endpoint: str, param: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        parse_body(raw, endpoint)
    assert info.value.status == 400
    assert info.value.param == param


def test_good_bodies_keep_unknown_fields() -> None:
    parsed = parse_body(body(model="m", messages=[{"role": "user", "content": "x"}], top_k=5, foo={"a": 1}), "chat")
    assert parsed["top_k"] == 5 and parsed["foo"] == {"a": 1}
    for prompt in ("text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        parse_body(body(model="m", prompt=prompt), "completions")


async def test_read_body_limits() -> None:
    async def receive_chunks(*chunks: bytes):
        queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

        async def receive() -> dict[str, object]:
            return queue.pop(0)

        return receive

    assert await read_body(await receive_chunks(b"ab", b"cd"), 10, None) == b"abcd"
    with pytest.raises(PayloadTooLarge):
        await read_body(await receive_chunks(b"a" * 6, b"a" * 6), 10, None)
    with pytest.raises(PayloadTooLarge):
        await read_body(await receive_chunks(b"x"), 10, "11")


# -- usage -----------------------------------------------------------------------------------
def test_sniff_json_usage_reads_the_trailing_usage() -> None:
    response = {
        "id": "x",
        "choices": [{"message": {"content": 'a "usage": {"prompt_tokens": 999}'}}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 16}},
    }
    usage = sniff_json_usage(json.dumps(response).encode())
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (20, 5, 16)
    missing = sniff_json_usage(json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode())
    assert missing.cached_tokens is None  # unknown, not 0
    assert sniff_json_usage(b'{"id": 1}') is None


def sse(*payloads: object) -> list[bytes]:
    out = []
    for p in payloads:
        out.append(b"data: " + (p if isinstance(p, bytes) else json.dumps(p, separators=(",", ":")).encode()) + b"\n\n")
    return out


CHUNK = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
USAGE = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 8}}


def test_relay_strips_gateway_added_usage_exactly() -> None:
    upstream = sse(CHUNK, {**CHUNK, "usage": None}, {"id": "c", "choices": [], "usage": USAGE}, b"[DONE]")
    expected = sse(CHUNK, CHUNK, b"[DONE]")
    relay = StreamRelay(strip_usage=True)
    joined = b"".join(upstream)
    # split at awkward places: mid-event and mid-boundary
    pieces = [joined[:7], joined[7:90], joined[90:91], joined[91:]]
    out = b"".join(relay.feed(p) for p in pieces) + relay.finish()
    assert out == b"".join(expected)
    assert relay.usage.cached_tokens == 8 and relay.usage.prompt_tokens == 10


def test_relay_passthrough_forwards_bytes_at_once_and_sniffs_usage() -> None:
    upstream = sse(CHUNK, {"id": "c", "choices": [], "usage": USAGE}, b"[DONE]")
    relay = StreamRelay(strip_usage=False)
    out = [relay.feed(chunk[:5]) + relay.feed(chunk[5:]) for chunk in upstream]
    assert out == upstream
    relay.finish()
    assert relay.usage.completion_tokens == 2


# -- auth -------------------------------------------------------------------------------------
def test_key_checker() -> None:
    off = KeyChecker([])
    assert not off.enabled
    checker = KeyChecker([sha256_hex("k1"), sha256_hex("k2").upper()])
    assert checker.enabled
    assert checker.check_authorization("Bearer k1")
    assert checker.check_authorization("bearer k2")
    assert not checker.check_authorization("Bearer k3")
    assert not checker.check_authorization("Basic k1")
    assert not checker.check_authorization(None)
    assert not checker.check("")


# -- engine scrape ----------------------------------------------------------------------------
CURRENT = """
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1.0
"""

DEPRECATED = """
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.75
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10.0
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{model_name="m"} 5.0
"""


def test_engine_scrape_current_names() -> None:
    stats = parse_engine_metrics(CURRENT)
    assert stats.running == 4.0 and stats.waiting == 2.0
    assert stats.kv_cache_usage == pytest.approx(0.375)  # averaged over engines
    assert stats.hit_rate == pytest.approx(0.25)
    assert (stats.block_size, stats.num_gpu_blocks) == (16, 4096)


def test_engine_scrape_deprecated_names_and_absence() -> None:
    old = parse_engine_metrics(DEPRECATED)
    assert old.kv_cache_usage == 0.75 and old.hit_rate == 0.5
    assert old.running is None  # absent means unknown, not 0
    empty = parse_engine_metrics("")
    assert empty.prefix_cache_hits is None and empty.hit_rate is None


def test_relay_handles_crlf_streams_and_usage_split_across_chunks() -> None:
    upstream = b"".join(e.replace(b"\n\n", b"\r\n\r\n") for e in sse(CHUNK, {"id": "c", "choices": [], "usage": USAGE}))
    upstream += b"data: [DONE]\r\n\r\n"
    cut = upstream.index(b'"usage"') + 3  # split inside the word "usage"
    stripping = StreamRelay(strip_usage=True)
    out = stripping.feed(upstream[:cut]) + stripping.feed(upstream[cut:]) + stripping.finish()
    assert out == sse(CHUNK)[0].replace(b"\n\n", b"\r\n\r\n") + b"data: [DONE]\r\n\r\n"
    assert stripping.usage.prompt_tokens == 10
    passing = StreamRelay(strip_usage=False)
    assert passing.feed(upstream[:cut]) + passing.feed(upstream[cut:]) == upstream
    passing.finish()
    assert passing.usage.cached_tokens == 8


def test_summary_engine_hit_rate_window_starts_at_the_first_scrape() -> None:
    """A gateway started in front of warm replicas must not report their lifetime hit rate."""
    from gateway.config import HealthSettings, ReplicaConfig
    from gateway.observe.outcome import Outcome
    from gateway.observe.stats import StatsBook
    from gateway.observe.summary import SummaryReporter
    from gateway.replicas.engine import EngineStats
    from gateway.replicas.pool import Replica

    replica = Replica(ReplicaConfig(name="r0", url="http://h:1"), object(), HealthSettings())  # type: ignore[arg-type]
    # the replica served 1,000,000 prompt tokens at 90 % hits before this gateway existed
    replica.set_engine(EngineStats(0.0, prefix_cache_queries=1_000_000, prefix_cache_hits=900_000))
    # then this gateway's window: 1,000 more tokens, 100 of them hits
    replica.set_engine(EngineStats(1.0, prefix_cache_queries=1_001_000, prefix_cache_hits=900_100))
    stats = StatsBook()
    stats.record(Outcome(route="main", endpoint="chat", status=200, prompt_tokens=1000, cached_tokens=100))
    summary = SummaryReporter(stats, lambda: [("main", [replica])], 10.0)
    ((_, fields),) = summary.lines()
    assert fields["hit_rate_engine"] == pytest.approx(0.1)
