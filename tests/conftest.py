"""Session-wide fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_server import TestRedis, start_redis


@pytest.fixture(scope="session")
def redis_session() -> Iterator[TestRedis]:
    """The session's Redis (see ``tests/redis_server.py``); started at most once, stopped at the end."""
    redis = start_redis()
    try:
        yield redis
    finally:
        redis.stop()


@pytest.fixture
def redis_url(redis_session: TestRedis) -> str:
    """A URL of a Redis that answers, or the test is skipped saying why there is none."""
    if redis_session.url is None:
        pytest.skip(redis_session.reason)
    return redis_session.url
