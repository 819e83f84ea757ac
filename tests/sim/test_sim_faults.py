"""Each fault mode does what it says, set by flag (options) or at run time (admin endpoint)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from sim_helpers import client, poll, scrape

from gateway.sim import DEFAULT_MODEL

MESSAGES = [{"role": "user", "content": "hello " * 40}]
STREAM_BODY = {"messages": MESSAGES, "max_tokens": 10, "stream": True}


def _set(url: str, **faults: object) -> dict:
    resp = httpx.post(url + "/sim/faults", json=faults)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _events(url: str, read_timeout: float = 5.0) -> tuple[list[str], Exception | None]:
    """SSE events received before the stream ended or failed."""
    events: list[str] = []
    try:
        timeout = httpx.Timeout(5.0, read=read_timeout)
        with httpx.stream("POST", url + "/v1/chat/completions", json=STREAM_BODY, timeout=timeout) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
    except (httpx.ReadTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
        return events, exc
    return events, None


def test_error_rate_by_flag_and_at_runtime(make_sim) -> None:
    url = make_sim(error_rate=1.0, error_status=500, enable_admin=True)
    c = client(url)
    with pytest.raises(openai.InternalServerError) as info:
        c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES)
    assert info.value.status_code == 500
    body = httpx.post(url + "/v1/completions", json={"prompt": "x"}).json()
    assert body["error"]["code"] == 500 and "fault injection" in body["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200  # only inference fails
    assert _set(url, error_status=503)["error_rate"] == 1.0  # omitted fields stay
    with pytest.raises(openai.APIStatusError) as info:
        c.completions.create(model=DEFAULT_MODEL, prompt="x")
    assert info.value.status_code == 503
    _set(url, error_rate=0.5)
    outcomes = []
    for _ in range(60):
        try:
            c.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=1)
            outcomes.append(True)
        except openai.APIStatusError:
            outcomes.append(False)
    assert 10 < outcomes.count(False) < 50  # a fraction, not all or none
    _set(url, reset=True)
    assert c.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=1).usage is not None
    assert httpx.get(url + "/sim/faults").json()["error_rate"] == 0.0


def test_extra_latency(make_sim) -> None:
    url = make_sim(enable_admin=True)
    c = client(url)
    c.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=1)
    _set(url, extra_latency_ms=150)
    start = time.perf_counter()
    c.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=1)
    slow = time.perf_counter() - start
    # a sleep is never shorter than asked; no comparison with an unfaulted request's time, which a
    # busy machine can stretch past 150 ms
    assert slow >= 0.15


def test_stall_after_chunks_keeps_the_connection_silent(make_sim, caplog: pytest.LogCaptureFixture) -> None:
    # No timing: read the three events, then wait (with a deadline) for the simulator to say it
    # is holding the stream; the connection is still open and nothing else came.
    url = make_sim(stall_after_chunks=3)
    events: list[str] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=STREAM_BODY, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        while len(events) < 3:
            line = next(lines)
            if line.startswith("data: "):
                events.append(line)
        poll(lambda: any("stalling stream" in r.getMessage() for r in caplog.records), timeout=30)
        assert not resp.is_closed
    assert all("[DONE]" not in e for e in events)


def test_drop_after_chunks_cuts_the_connection(make_sim) -> None:
    url = make_sim(enable_admin=True)
    _set(url, drop_after_chunks=2)
    events, error = _events(url)
    assert len(events) == 2 and isinstance(error, httpx.RemoteProtocolError | httpx.ReadError)
    # the SDK sees a broken stream, not a clean end
    stream = client(url).chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, stream=True)
    with pytest.raises((httpx.HTTPError, openai.APIError)):
        for _ in stream:
            pass
    _set(url, reset=True)
    events, error = _events(url)
    assert error is None and events[-1] == "data: [DONE]"


def test_faults_also_apply_at_nonzero_time_scale(make_sim) -> None:
    url = make_sim(time_scale=1.0, decode_ms_per_token=2, drop_after_chunks=4)
    events, error = _events(url)
    assert len(events) == 4 and error is not None


def test_restart_flushes_the_prefix_cache(sim: str, oai: openai.OpenAI) -> None:
    prompt = list(range(100, 300))
    oai.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=1)
    warm = oai.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=1)
    assert warm.usage.prompt_tokens_details.cached_tokens == 192
    out = httpx.post(sim + "/sim/restart").json()
    assert out["restarted"] is True
    cold = oai.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=1)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert httpx.get(sim + "/sim/state").json()["num_cached_blocks"] > 0  # refilled by the cold request


def test_restart_fails_in_flight_requests_and_can_take_downtime(make_sim) -> None:
    url = make_sim(time_scale=1.0, decode_ms_per_token=10, enable_admin=True)
    c = client(url)
    outcome: list[object] = []

    def slow() -> None:
        try:
            outcome.append(c.completions.create(model=DEFAULT_MODEL, prompt="slow", max_tokens=2000))
        except openai.APIStatusError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=slow)
    thread.start()
    poll(lambda: httpx.get(url + "/sim/state").json()["running"] == 1)
    # a downtime far longer than the checks take (a busy machine cannot end it early), then
    # ended on purpose: {"reset": true} also ends a restart's downtime
    out = httpx.post(url + "/sim/restart", json={"downtime_ms": 120_000}).json()
    assert out["aborted_requests"] == 1
    assert httpx.get(url + "/health").status_code == 503  # restarting
    with pytest.raises(openai.APIStatusError) as info:
        c.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=1)
    assert info.value.status_code == 503
    thread.join(timeout=30)
    assert isinstance(outcome[0], openai.APIStatusError) and outcome[0].status_code == 503
    _set(url, reset=True)
    poll(lambda: httpx.get(url + "/health").status_code == 200)
    assert c.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=1).usage is not None
    assert scrape(url)["vllm:request_success_total{finished_reason=abort}"] == 1


def test_admin_endpoints_are_off_by_default_and_validate(make_sim) -> None:
    url = make_sim()
    for method, path in (("GET", "/sim/faults"), ("POST", "/sim/faults"), ("POST", "/sim/restart")):
        assert httpx.request(method, url + path, json={}).status_code == 404
    admin = make_sim(enable_admin=True)
    for bad in ({"error_rate": 2}, {"error_status": 200}, {"nonsense": 1}, {"stall_after_chunks": -1}):
        resp = httpx.post(admin + "/sim/faults", json=bad)
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
    assert httpx.post(admin + "/sim/faults", content=b"[1]").status_code == 400
    assert httpx.get(admin + "/sim/faults").json()["error_rate"] == 0.0
