"""Early context-length 400s and per-key 429s (local and shared through Redis)."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from gateway.config import sha256_hex
from gateway.http.server import RunningGateway, serve_in_thread
from gateway.limits.context import prompt_tokens_lower_bound
from gateway.limits.local import LocalBuckets
from tests.configs import gateway_config
from tests.hardening.hostile_upstream import MODEL, run_upstream
from tests.polling import wait_for

#: two client keys: with auth on, each configured key has its own buckets
AUTH = {"api_keys_sha256": [sha256_hex("k1"), sha256_hex("k2")]}


def _client(gw: RunningGateway, key: str = "k1") -> OpenAI:
    return OpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0, timeout=30)


def _chat(client: OpenAI, text: str = "hi", model: str = MODEL, **extra: Any) -> Any:
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], **extra)


# -- context length ------------------------------------------------------------------------
def test_lower_bound_counts_ids_exactly_and_text_conservatively() -> None:
    assert prompt_tokens_lower_bound("completions", {"prompt": list(range(5000))}, 128) == 5000
    assert prompt_tokens_lower_bound("completions", {"prompt": [[1] * 10, [2] * 30]}, 128) == 30
    assert prompt_tokens_lower_bound("chat", {"messages": [{"role": "user", "content": "x" * 1280}]}, 128) == 10
    parts = [{"type": "text", "text": "é" * 640}]  # 2 bytes each
    assert prompt_tokens_lower_bound("chat", {"messages": [{"role": "user", "content": parts}]}, 128) == 10
    assert prompt_tokens_lower_bound("embeddings", {"input": ["a" * 256, "b"]}, 128, exact_window_tokens=7) == 7


def test_prompts_that_cannot_fit_get_an_early_400() -> None:
    with run_upstream(max_model_len=4096) as (url, seen), serve_in_thread(gateway_config([url])) as gw:
        client = _client(gw)
        forwarded_before = len([r for r in seen if r["path"].startswith("/v1/chat")])
        with pytest.raises(openai.BadRequestError) as too_long:
            _chat(client, "x" * (128 * 4096))
        with pytest.raises(openai.BadRequestError) as with_output:
            _chat(client, "x" * 100, max_tokens=5000)  # max_tokens alone over the window: vLLM refuses it too
        with pytest.raises(openai.BadRequestError) as ids:
            client.completions.create(model=MODEL, prompt=list(range(4096)))
        fits = _chat(client, "x" * (128 * 4000), max_tokens=10)
        # prompt + max_tokens over the window, the prompt fitting: vLLM 0.32 serves it (output clamped)
        clamped = _chat(client, "x" * (128 * 4000), max_tokens=200)
        forwarded = len([r for r in seen if r["path"].startswith("/v1/chat")]) - forwarded_before
    for error in (too_long, with_output, ids):
        assert error.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    assert "4096" in str(too_long.value)
    assert "max_tokens=5000 cannot be greater than max_model_len=4096" in str(with_output.value)
    assert fits.choices[0].message.content == "echo" and clamped.choices[0].message.content == "echo"
    assert forwarded == 2  # the two that vLLM would serve reached the replica


def test_a_prompt_estimated_over_the_context_is_forwarded_and_recorded_nowhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not certain to be refused (the bytes bound), so forwarded; but its estimate is over the
    model's max_model_len, so the policy records nothing for it (vLLM would answer 400, and the
    record would have pushed other prompts out of the replica's modelled cache)."""
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", "admin-secret")
    routes = [{"name": "main", "policy": "prefix"}]
    long_text = "the quick brown fox jumps " * 2000  # ~10k tokens, 52k bytes (~400 by the bytes bound)
    with (
        run_upstream(max_model_len=4096) as (url, _seen),
        serve_in_thread(gateway_config([url], routes=routes)) as gw,
    ):
        assert _chat(_client(gw), long_text).choices[0].message.content == "echo"
        admin = {"Authorization": "Bearer admin-secret"}
        body = {"model": MODEL, "messages": [{"role": "user", "content": long_text}]}
        plan = httpx.post(f"{gw.url}/admin/explain", json=body, headers=admin, timeout=10).json()
        short = {"model": MODEL, "messages": [{"role": "user", "content": "the quick brown fox " * 50}]}
        fits = httpx.post(f"{gw.url}/admin/explain", json=short, headers=admin, timeout=10).json()
    assert plan["decision"]["over_context"]["max_model_len"] == 4096
    assert plan["decision"]["over_context"]["prompt_tokens_estimate"] > 4096
    assert plan["decision"]["matched_blocks"] == 0  # the one served before was recorded nowhere
    assert "over_context" not in fits["decision"]


def test_context_check_can_be_turned_off() -> None:
    with (
        run_upstream(max_model_len=16) as (url, _seen),
        serve_in_thread(gateway_config([url], limits={"context_check": False})) as gw,
    ):
        assert _chat(_client(gw), "x" * 10_000).choices[0].message.content == "echo"


# -- per-key rate and concurrency ----------------------------------------------------------
def test_token_bucket_refills() -> None:
    buckets = LocalBuckets(rate=2.0, burst=2.0)
    assert buckets.take("a", 0.0) == 0.0 and buckets.take("a", 0.0) == 0.0
    assert buckets.take("a", 0.0) == pytest.approx(0.5)
    assert buckets.take("a", 0.5) == 0.0  # one token back after 1/rate seconds
    assert buckets.take("b", 0.5) == 0.0  # keys are independent


def _rate_limited(gw: RunningGateway, key: str) -> httpx.Response:
    return httpx.post(
        f"{gw.openai_base_url}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def test_rate_limit_per_key_is_a_429_with_retry_after(upstream: tuple[str, list[dict[str, Any]]]) -> None:
    limits = {"per_key_requests_per_s": 0.01, "per_key_burst": 2}
    with serve_in_thread(gateway_config([upstream[0]], limits=limits, auth=AUTH)) as gw:
        assert [_rate_limited(gw, "k1").status_code for _ in range(2)] == [200, 200]
        refused = _rate_limited(gw, "k1")
        other = _rate_limited(gw, "k2")
        with pytest.raises(openai.RateLimitError):
            _chat(_client(gw, "k1"))
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and error["code"] == "rate_limit_exceeded" and error["message"]
    assert int(refused.headers["retry-after"]) >= 1 and int(refused.headers["retry-after-ms"]) > 0
    assert other.status_code == 200


@pytest.mark.slow
def test_concurrency_limit_per_key(upstream: tuple[str, list[dict[str, Any]]]) -> None:
    with serve_in_thread(gateway_config([upstream[0]], limits={"per_key_concurrency": 1}, auth=AUTH)) as gw:
        results: list[Any] = []
        slow = threading.Thread(target=lambda: results.append(_chat(_client(gw, "k1"), model="slow")))
        slow.start()
        wait_for(lambda: gw.gateway.replicas["r0"].in_flight == 1, what="the slow request in flight")
        with pytest.raises(openai.RateLimitError) as refused:
            _chat(_client(gw, "k1"))
        assert _chat(_client(gw, "k2")).choices  # another key is not affected
        slow.join(30)
        assert _chat(_client(gw, "k1")).choices  # the slot came back
    assert refused.value.body["code"] == "concurrency_limit_exceeded"  # type: ignore[index]
    assert results and results[0].choices


def test_rate_limit_is_shared_through_redis(upstream: tuple[str, list[dict[str, Any]]], redis_url: str) -> None:
    channel = f"harden-test-{uuid.uuid4().hex[:8]}"
    state = {"backend": "redis", "redis_url": redis_url, "channel": channel, "share_load": False}
    # a generous bound: this checks sharing, and a busy test machine must not trip the breaker
    limits = {"per_key_requests_per_s": 0.01, "per_key_burst": 2, "redis_timeout_ms": 2000}
    config = gateway_config([upstream[0]], state=state, limits=limits)
    with serve_in_thread(config) as a, serve_in_thread(config) as b:
        statuses = [_rate_limited(a, "shared").status_code, _rate_limited(b, "shared").status_code]
        third = _rate_limited(a, "shared")
        fourth = _rate_limited(b, "shared")
    assert statuses == [200, 200]
    assert third.status_code == 429 and fourth.status_code == 429


def test_redis_down_falls_back_to_local_limits(upstream: tuple[str, list[dict[str, Any]]]) -> None:
    state = {"backend": "redis", "redis_url": "redis://127.0.0.1:1/0", "share_load": False}
    limits = {"per_key_requests_per_s": 0.01, "per_key_burst": 1}
    with serve_in_thread(gateway_config([upstream[0]], state=state, limits=limits)) as gw:
        first, second = _rate_limited(gw, "k"), _rate_limited(gw, "k")
        fallbacks = gw.gateway.limiter.fallbacks
    assert (first.status_code, second.status_code) == (200, 429)
    assert fallbacks >= 2


def test_the_models_own_tokenizer_counts_exactly() -> None:
    """Llama 3.1 is a known family: its tokens are counted in its own vocabulary, so a prompt far
    below the bytes bound but over max_model_len in real tokens is refused too."""
    llama = "meta-llama/Llama-3.1-8B-Instruct"
    text = " hello" * 3000  # ~3,000 Llama tokens, 18,000 bytes (only ~140 by the bytes bound)
    routes = [{"name": "main", "policy": "prefix"}]
    with (
        run_upstream(max_model_len=2048, models=(llama, MODEL)) as (url, _seen),
        serve_in_thread(gateway_config([url], routes=routes)) as gw,
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            _chat(_client(gw), text, model=llama)
        unknown_family = _chat(_client(gw), text, model=MODEL)  # cl100k approximates: no certainty, forwarded
    assert refused.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    assert unknown_family.choices[0].message.content == "echo"


def test_a_state_server_without_scripting_means_local_limits(upstream: tuple[str, list[dict[str, Any]]]) -> None:
    """``serve --workers`` shares state through a small broker that has no EVAL: the limits then
    stay in each process instead of trying (and failing) a round trip per request."""
    import asyncio
    import tempfile

    from gateway.limits.admission import KeyLimiter
    from gateway.state.local_broker import LocalBroker

    async def scenario() -> tuple[list[float], bool]:
        with tempfile.TemporaryDirectory() as tmp:
            broker = LocalBroker(f"{tmp}/broker.sock")
            await broker.start()
            limiter = KeyLimiter(0, 0.01, 1, redis_url=f"unix://{tmp}/broker.sock")
            await limiter.start()
            try:
                outcomes = []
                for _ in range(3):
                    try:
                        await limiter.admit("k")
                        outcomes.append(0.0)
                    except Exception as exc:  # RateLimited
                        outcomes.append(exc.retry_after_s)  # type: ignore[attr-defined]
                return outcomes, limiter.shared is None
            finally:
                await limiter.stop()
                await broker.stop()

    outcomes, gave_up_shared = asyncio.run(scenario())
    assert outcomes[0] == 0.0 and outcomes[1] > 0 and outcomes[2] > 0
    assert gave_up_shared
