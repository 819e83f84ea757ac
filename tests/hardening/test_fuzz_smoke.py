"""A short fuzz run in CI: the benchmark's hostile requests against an in-process gateway.

``benchmarks/bench_fuzz.py`` sends thousands of these to a gateway process; this sends a few
hundred of each family and asserts the same zeros: no 5xx (a 503 ``server_overloaded`` with
``retry-after`` is an intended shed, not a failure), every error in OpenAI's shape, every
request answered, no traceback logged, slow partial requests closed, every slot and body
byte given back after the slow uploads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest

from benchmarks.fuzz_cases import Tally, run_bodies, run_hostile, run_raw, run_slow
from benchmarks.fuzz_keys import run_keys
from benchmarks.fuzz_uploads import run_uploads
from gateway.config import sha256_hex
from gateway.http.server import RunningGateway, serve_in_thread
from tests.configs import gateway_config
from tests.polling import wait_for

MAX_BODY = 1024 * 1024
SERVER = {"port": 0, "header_timeout_s": 1.0, "body_timeout_s": 1.0, "max_body_bytes": MAX_BODY}


@pytest.fixture(scope="module")
def gw(sim_url: str) -> Iterator[RunningGateway]:
    routes = [{"name": "fuzz", "policy": "prefix"}]
    with serve_in_thread(gateway_config([sim_url], server=SERVER, routes=routes)) as running:
        yield running


def _assert_clean(tally: Tally) -> None:
    summary = tally.as_dict()
    assert (summary["gateway_5xx"], summary["non_openai_errors"], summary["no_answer"]) == (0, 0, 0), summary


def _tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


@pytest.mark.slow
def test_hypothesis_bodies(gw: RunningGateway, caplog: pytest.LogCaptureFixture) -> None:
    tally = Tally()
    with caplog.at_level(logging.WARNING):
        run_bodies(gw.url, 300, tally)
    _assert_clean(tally)
    assert tally.statuses[200] > 0 and tally.statuses[400] > 0  # both valid and broken requests were sent
    assert _tracebacks(caplog) == []


@pytest.mark.slow
def test_hostile_bodies_and_raw_garbage(gw: RunningGateway, caplog: pytest.LogCaptureFixture) -> None:
    hostile, raw = Tally(), Tally()
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    with caplog.at_level(logging.WARNING):
        run_hostile(gw.url, MAX_BODY, hostile)
        run_raw(host, int(port), raw)
    _assert_clean(hostile)
    _assert_clean(raw)
    assert raw.statuses[431] >= 2 and raw.statuses[400] > 50
    assert _tracebacks(caplog) == []


@pytest.mark.slow
def test_slow_partial_requests_are_closed(gw: RunningGateway) -> None:
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    result = run_slow(host, int(port), gw.url, connections=20, deadline_s=10)
    assert result["still_open_after_deadline"] == 0, result
    assert result["normal_requests_served_meanwhile"] == "20/20"
    assert httpx.get(f"{gw.url}/health", timeout=5).status_code == 200


@pytest.mark.slow
def test_api_key_spellings_and_made_up_tokens(sim_url: str) -> None:
    key = "smoke-key-0123456789"
    routes = [{"name": "fuzz", "policy": "prefix"}]
    limits = {"per_key_requests_per_s": 100_000, "per_key_burst": 100_000}
    config = gateway_config(
        [sim_url], server=SERVER, routes=routes, limits=limits, auth={"api_keys_sha256": [sha256_hex(key)]}
    )
    tally = Tally()
    with serve_in_thread(config) as running:
        host, port = running.url.removeprefix("http://").rsplit(":", 1)
        result = run_keys(host, int(port), key, tally, rounds=2, tokens=40)
    _assert_clean(tally)
    for spelling in ("Bearer", "bearer", "BEARER", "two spaces"):
        assert result["spellings"][spelling] == {"200": 2}, result["spellings"]
    assert result["spellings"]["Basic scheme"] == {"401": 2}
    assert result["made_up_tokens"] == {"401": 40}


@pytest.mark.slow
def test_slow_and_oversize_uploads_are_shed_or_answered_and_release_everything(sim_url: str) -> None:
    server = {**SERVER, "body_timeout_s": 1.0, "max_concurrency": 30, "max_buffered_body_bytes": 4 * MAX_BODY}
    routes = [{"name": "fuzz", "policy": "prefix"}]
    uploads, neighbours = Tally(), Tally()
    with serve_in_thread(gateway_config([sim_url], server=server, routes=routes)) as running:
        host, port = running.url.removeprefix("http://").rsplit(":", 1)
        result = run_uploads(host, int(port), running.url, 80, MAX_BODY, 8.0, uploads, neighbours)
        capacity = running.gateway.capacity
        wait_for(lambda: capacity.in_flight == 0 and capacity.buffered_bytes == 0, what="caps idle again")
        assert capacity.peak_buffered_bytes <= 4 * MAX_BODY and capacity.peak_in_flight <= 30
    _assert_clean(uploads)
    _assert_clean(neighbours)
    assert uploads.shed > 0 and uploads.statuses[413] > 0 and uploads.statuses[200] > 0, uploads.as_dict()
    assert result["health_probes_failed"] == 0 and result["health_probes"], result
