"""Streams that stall or drop, and streams the client aborts."""

from __future__ import annotations

import httpx
import openai
import pytest
from fault_helpers import MODEL, Load, gateway, sdk, set_faults, wait_for

from gateway.sim.launcher import ReplicaGroup
from tests.gateway.gw_helpers import metric_samples

MESSAGES = [{"role": "user", "content": "stream to me"}]


@pytest.mark.slow
def test_stalled_streams_end_with_an_error_event(fleet: ReplicaGroup) -> None:
    """A stream that goes silent after its first chunks ends with an OpenAI-style error event
    after the idle timeout (the client's own timeout is far longer: it never has to fire)."""
    for url in fleet.urls:
        set_faults(url, stall_after_chunks=3)
    # chunks come every 10 ms: a 0.3 s silence is a stall (any silence this long ends the same way)
    with gateway(fleet.urls, upstream={"stream_idle_timeout_s": 0.3}) as gw:
        client = sdk(gw, timeout=30)
        for _ in range(3):
            chunks = 0
            with pytest.raises(openai.APIError) as info:
                for _chunk in client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=20, stream=True
                ):
                    chunks += 1
            assert type(info.value) is openai.APIError  # an error event, not a timeout or a cut
            assert info.value.body["code"] == "upstream_stream_idle_timeout"
            assert chunks >= 1
        text = httpx.get(f"{gw.url}/metrics").text
        errors = {
            dict(k[1]).get("kind"): v for k, v in metric_samples(text).items() if k[0] == "prefix_gateway_errors_total"
        }
        assert errors.get("upstream_stalled") == 3


@pytest.mark.slow
def test_a_replica_that_drops_streams_is_held_out_instead_of_flapping(fleet: ReplicaGroup) -> None:
    """Back from an ejection a replica is on probation (one failure ejects it again) and each
    ejection lasts twice the last: after the first ejection each return costs clients at most
    the streams in flight on it, not another run of passive_5xx_threshold failures."""
    set_faults(fleet.urls[0], drop_after_chunks=2)
    concurrency = 2
    eject_s = 0.25  # ejections of 0.25, 0.5, 1, 2 s: a stream (10 chunks of 10 ms) fits many times in each
    health = {"passive_5xx_threshold": 5, "eject_s": eject_s, "max_eject_s": 30}
    with gateway(fleet.urls, health=health) as gw:
        r0 = gw.gateway.replicas["r0"]
        load = Load(gw.openai_base_url, concurrency=concurrency, stream_share=1.0, max_tokens=10).start()
        try:
            wait_for(lambda: r0.ejections_total >= 1, timeout=30, what="the first ejection")
            first = r0.failures_total
            wait_for(lambda: r0.ejections_total >= 4, timeout=30, what="three more ejections")
            later = r0.failures_total - first
        finally:
            assert load.stop()
        tally = load.tally
        assert tally.broken == 0 and tally.hung == 0, tally.as_dict()  # every drop ended with an error event
        # three returns: flapping would pass >= 3 x 5 failures; probation passes <= in-flight per return
        assert later <= 3 * concurrency + concurrency, (later, tally.as_dict())
        assert r0.ejected_until - r0.returned_at >= 4 * eject_s - 0.01 or not r0.healthy  # backed off: x1, x2, x4, x8


@pytest.mark.slow
def test_aborted_requests_are_counted_on_the_replica_they_reached(fleet: ReplicaGroup) -> None:
    """A client that gives up while the replica has not answered yet: 499 on that replica, not "none"."""
    set_faults(fleet.urls[0], extra_latency_ms=3000)
    with gateway(fleet.urls[:1]) as gw:
        impatient = sdk(gw, timeout=0.3)
        for stream in (False, True):
            with pytest.raises(openai.APITimeoutError):
                impatient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, stream=stream)

        def counted() -> dict[str, float]:
            samples = metric_samples(httpx.get(f"{gw.url}/metrics").text)
            out: dict[str, float] = {}
            for (name, labels), value in samples.items():
                if name == "prefix_gateway_requests_total":
                    key = f"{dict(labels)['replica']}/{dict(labels)['status_class']}"
                    out[key] = out.get(key, 0) + value
            return out

        wait_for(lambda: counted().get("r0/4xx") == 2, timeout=10, what="both aborts counted on r0")
        assert "none/4xx" not in counted()
